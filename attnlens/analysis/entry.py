"""The analyses' entry points on every kind of model: a model of one stack of blocks (a decoder, an encoder, a
multimodal model's language model) and an encoder-decoder (`analysis.seq2seq`), which builds on the former."""

from __future__ import annotations

from . import reasons, seq2seq
from .attribution import stack_attribution


def attribution(
    model,
    prompt,
    rows=-1,
    target=None,
    versus=None,
    direction=None,
    layers=None,
    max_new_tokens: int = 0,
    decoder_input_ids=None,
):
    """Direct attribution of `target`'s logit (minus `versus`'s), or of `direction . final_norm_output`, at query
    `rows` of `prompt` (default the last), split by layer, head and source position; see the module's docstring.

    `layers` limits which layers are split by head (the others give their attention update as one term). With
    `max_new_tokens`, the prompt is generated from greedily and a list comes back: the prefill's attribution, then one
    per decode step (its new row, over every key of the context; generated sources are labelled `<generated i>`).
    Runs on `StandardizedTransformer` (eager attention, or `rebuild_patterns=True`) and `StandardizedVLLM` (in the
    worker, where only the terms leave it).

    On `StandardizedSeq2Seq`, `prompt` is the encoder's input and `decoder_input_ids` the decoder's tokens: the
    decoder logit is split by decoder head and source, and through the cross-attention by encoder position
    (`attnlens.analysis.seq2seq`; `layers` and `max_new_tokens` are not taken there)."""
    if hasattr(model, "stacks"):  # an encoder-decoder
        if layers is not None or max_new_tokens:
            raise ValueError(
                "attribution on an encoder-decoder splits every layer of one teacher-forced run: "
                "layers= and max_new_tokens= are not taken"
            )
        return seq2seq.seq2seq_attribution(model, prompt, decoder_input_ids, rows, target, versus, direction)
    if decoder_input_ids is not None:
        raise ValueError("decoder_input_ids goes with an encoder-decoder (StandardizedSeq2Seq)")
    return stack_attribution(model, prompt, rows, target, versus, direction, layers, max_new_tokens)


def served(model, layer: int) -> dict[str, str | None]:
    """Every analysis (`reasons.ANALYSES`) -> None where `layer` of `model` serves it, else why not: what
    `support(layer)` lists as its `analyses` (registered with the access layer when this package is imported)."""
    return (seq2seq.served if hasattr(model, "stacks") else reasons.served)(model, layer)


def unavailable(model, layer: int) -> dict[str, str]:
    """Analysis name (`ANALYSES`) -> why `layer` of `model` does not serve it; absent where it does. For
    `attribution`, a layer that cannot be split by head still contributes its attention update as one term."""
    return {name: reason for name, reason in served(model, layer).items() if reason is not None}
