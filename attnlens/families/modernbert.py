"""ModernBERT: a pre-norm encoder whose layers alternate global attention (every key) with local attention (a band of
keys on both sides of each query), each kind rotating its queries and keys with a rotary embedding of its own theta.

The block is ModernBERT-decoder's (`modernbert_decoder.py`: `attn_norm`, the identity on layer 0, then `attn`, renamed
`self_attn`, whose output projection is `Wo`; `mlp_norm` and a GLU MLP `Wo(drop(act(a) * b))`; `model.final_norm`,
then the prediction head `head` and the vocabulary projection `decoder`), on an encoder: its attention is
bidirectional, and queries and keys come out of one fused projection (`Wqkv`, viewed as `[batch, seq, 3, heads,
head_dim]` and unbound) before the rotary embedding.

`config.layer_types` says which layers are local (`sliding_attention`; from `global_attn_every_n_layers`, every n-th
layer global starting at layer 0): a local query `i` sees key `j` where `|i - j| <= config.sliding_window`, which is
`config.local_attention // 2` (transformers' `create_bidirectional_sliding_window_mask`). Global layers rotate with
`config.rope_parameters["full_attention"]["rope_theta"]` (160000 by default), local layers with
`config.rope_parameters["sliding_attention"]["rope_theta"]` (10000): the queries served are after the rotation.

Padding, as transformers 5.25 runs it: masked, never unpadded. `ModernBertModel.forward` builds a 4D additive mask
from `attention_mask` for each kind of layer (`create_bidirectional_mask`; `create_bidirectional_sliding_window_mask`,
the band and the padded keys both masked) and every layer runs on the padded `[batch, seq]` batch; the unpadded path
of the 4.x releases (`_unpad_modernbert_input`, packed sequences for flash attention) is gone, and the attention's
docstring that still speaks of unpadded sequences is stale. Padded keys get the dtype's minimum, so their
probabilities are exactly zero; padded queries still attend to the real keys, and on a local layer a padded query with
no real key inside its band has every key masked alike (each score the dtype's minimum), so its row is uniform.
Positions are `arange(seq)` whatever the mask; rotary scores depend on `i - j` only, and the band too, so a shifted
prompt scores alike (up to rounding).

`BidirectionalWindow` is the score function of such a band on bidirectional layers, shared with the other encoders
that have local layers (`ultrabert`): `half_window(config, layer)` says each layer's band (None: global).
"""

from __future__ import annotations

import torch

from ..family import Tiny
from ..locations import INTERFACE_CALL, Operation, softmax_argument
from ..parts import scoring
from ..parts.sizes import Sizes, same_as
from ..parts.vllm import encoder_on_vllm
from .modernbert_decoder import ModernBertDecoder

#: The probability note of a bidirectional layer that sees every key.
GLOBAL = "bidirectional global attention: every query sees every key that is not padding"


class BidirectionalWindow(scoring.Bidirectional):
    """Bidirectional attention, masked to a band `|query - key| <= half_window` on local layers (the keys on both
    sides of each query, itself included) and to the real keys where a batch is padded: what transformers'
    `create_bidirectional_sliding_window_mask` builds (and `create_bidirectional_mask` on global layers)."""

    def sliding_window(self, config, layer: int) -> int | None:
        """None: no causal window (a query sees later keys too; the band is `half_window`, applied by `mask`)."""
        return None

    def half_window(self, config, layer: int) -> int | None:
        """How many keys on each side of a query `layer` lets it see, or None where it sees every key: the config's
        `sliding_window` on the layers `layer_types` calls `sliding_attention`."""
        if config.layer_types[layer] != "sliding_attention":
            return None
        return config.sliding_window

    def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
        key_positions = torch.arange(num_keys, device=device)
        query_positions = key_positions[num_keys - num_queries :, None]
        visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
        band = self.half_window(config, layer)
        if band is not None:
            visible &= (query_positions - key_positions[None, :]).abs() <= band
        visible = visible[None, None]
        if key_mask is not None:
            visible = visible & key_mask[:, None, None, :].bool().to(visible.device)
        return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), torch.finfo(dtype).min)


def band_note(family, config, layer) -> str:
    """The probabilities' note on `layer`: the band its queries see, or every key."""
    band = family.score_function().half_window(config, layer)
    if band is None:
        return GLOBAL
    return (
        f"bidirectional local attention: each query sees the keys within {band} positions on either side, itself "
        f"included ({2 * band + 1} keys away from the edges); the others are exactly zero (a padded query with no "
        f"real key inside its band has every key masked alike, and spreads its row evenly)"
    )


def rotary_note(family, config, layer) -> str:
    """The queries' and keys' note on `layer`: rotated with its kind's theta, where each kind of layer has its own
    (`rope_parameters` by layer type), else the one theta; and how many channels of each head, where not all."""
    kind = (getattr(config, "layer_types", None) or [None] * (layer + 1))[layer]
    parameters = config.rope_parameters.get(kind, config.rope_parameters)
    whose = f" of {kind} layers" if kind in config.rope_parameters else ""
    note = f"after the rotary embedding{whose}, theta {parameters['rope_theta']:g}"
    if kind in config.rope_parameters:
        note += f" (rope_parameters[{kind!r}])"
    factor = parameters.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        note += (
            f"; only each head's first {int(head_dim * factor)} channels are rotated (partial_rotary_factor "
            f"{factor:g}), the rest pass unchanged"
        )
    return note


class ModernBert(ModernBertDecoder):
    model_types = ("modernbert",)
    vllm = encoder_on_vllm("ModernBERT")
    tiny = Tiny(
        "ModernBertConfig",
        "ModernBertForMaskedLM",
        {
            "num_key_value_heads": None,
            "local_attention": 4,  # a band of 2 keys each side: narrower than a test prompt
            "global_attn_every_n_layers": 2,  # global, local, global, ...
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
    )
    sizes = Sizes(
        num_kv_heads=(same_as("num_heads"),),
        scale=(lambda module, found: module.head_dim**-0.5,),  # passed inline: scaling=self.head_dim**-0.5
    )

    def locations(self):
        probabilities, probabilities_anchor = self.eager.probabilities
        return {
            **super().locations(),
            "attention_scores": softmax_argument(INTERFACE_CALL),
            "attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=probabilities_anchor),
        }

    class ScoreFunction(BidirectionalWindow):
        pass

    kind_notes = {
        "*": {
            "attention_queries": rotary_note,
            "attention_keys": rotary_note,
            "attention_values": "the third part of Wqkv's output, viewed [batch, seq, 3, heads, head_dim] and unbound",
            "attention_probabilities": band_note,
            "attention_scores": "what the softmax receives: queries @ keys^T / sqrt(head_dim), plus the mask (the band "
            "on local layers, padded keys; none on a global layer of an unpadded batch)",
            "attention_output": "Wo's output (out_drop follows: the identity without attention dropout)",
            "logits": "decoder(head(final_norm_output)): head is a dense layer, activation and norm",
        }
    }
