"""Funnel Transformer: an encoder attnlens knows and does not serve (`RefusedEncoder`), and why.

`FunnelModel` (the masked LM's) runs an encoder of groups of `FunnelLayer`s (`encoder.blocks[b][l]`, each layer run
`block_repeats[b]` times), pooling the sequence between groups: the first layer of each pooled group attends from the
pooled (about half as long) queries to the previous length's keys and values (`pool_q_only`), and a later group's
layers at the pooled length. Each `FunnelRelMultiheadAttention` adds to its content scores (`(q + r_w_bias) @ k`)
relative positional terms (`r_r_bias`, `r_kernel` over relative position embeddings, with their own shift on a
pooled layer; a factorized form under `attention_type="factorized"`) and token-type terms (`r_s_bias`, `seg_embed`),
the [CLS] position's terms masked out (`separate_cls`), and subtracts a large constant where keys are padding. Its
decoder then upsamples the last group's output, adds the first group's, and runs `num_decoder_layers` more layers.
"""

from __future__ import annotations

from ..family import RefusedEncoder


class Funnel(RefusedEncoder):
    model_types = ("funnel",)
    refused = (
        "Funnel Transformer pools the queries between groups of blocks (the first layer of a pooled group attends from "
        "the pooled, shorter sequence to the previous length's keys), adds relative positional and token-type terms "
        "to its content scores (r_r_bias and r_kernel over relative positions, r_s_bias and seg_embed, the [CLS] "
        "position's terms masked out), and ends in a decoder that upsamples the last group's output and adds the "
        "first group's; attnlens has no family that reproduces these scores or indexes this stack of groups and "
        "repeats, so no value of its blocks is served (a list of blocks found in it is one stack's, not the model's "
        "blocks in order); its embeddings and logits are"
    )
