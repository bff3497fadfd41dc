"""Granite: the Llama layout with four multipliers from the config: the score scale, the residual branches, the
embeddings and the logits.

Scores are `queries @ keys^T * attention_multiplier` (not `1/sqrt(head_dim)`). Each sublayer's output is scaled by
`residual_multiplier` before the residual add, so `layer_mid = layer_input + residual_multiplier * attention_output`
and `layer_output = layer_mid + residual_multiplier * mlp_output`. `embeddings` is the token embedding module's output;
the first block receives it times `embedding_multiplier`. `logits` are the LM head's output divided by
`logits_scaling`, as the caller receives them.

vLLM's Granite passes the residual stream between blocks as one tensor (no `(hidden, residual)` pair, no fused
norms), so the residual values are module inputs and outputs there; it multiplies the embedding module's output by
`embedding_multiplier` in place, so `embeddings` is a copy taken before that.
"""

from dataclasses import replace

from ..family import Tiny
from ..locations import Derived, ModuleOutput
from ..locations.views import copy_with_batch, drop_batch
from ..parts import identities
from ..parts.vllm import unpaired_locations
from .llama import Llama


def _granite_vllm_locations(family):
    embeddings = Derived(
        ModuleOutput(family.embed_tokens),
        copy_with_batch,
        drop_batch,
        in_place=False,
        note="a copy: vLLM then multiplies this tensor by embedding_multiplier in place; assign it to edit",
        why_not="it is a copy (vLLM multiplies the tensor by embedding_multiplier in place)",
    )
    return {**unpaired_locations(family, Llama.vllm.locations(family)), "embeddings": embeddings}


class Granite(Llama):
    model_types = ("granite",)
    # Multipliers far from 1 (and a score scale unlike 1/sqrt(16)), so a family ignoring one fails the identities.
    tiny = Tiny(
        "GraniteConfig",
        "GraniteForCausalLM",
        {"attention_multiplier": 0.5, "residual_multiplier": 0.5, "embedding_multiplier": 2.0, "logits_scaling": 4.0},
    )
    vllm = replace(Llama.vllm, model_types=("granite",), locations=_granite_vllm_locations)

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            return stream + update * block.residual_multiplier

    kind_notes = {
        "*": {
            "attention_scores": "scaled by config.attention_multiplier ({config.attention_multiplier:g}), "
            "not 1/sqrt(head_dim)",
            "layer_mid": "layer_input + residual_multiplier ({config.residual_multiplier:g}) * attention_output",
            "layer_output": "layer_mid + residual_multiplier ({config.residual_multiplier:g}) * mlp_output",
            "embeddings": "before embedding_multiplier: layers[0].layer_input is embeddings * "
            "{config.embedding_multiplier:g}",
            "logits": "the LM head's output divided by logits_scaling ({config.logits_scaling:g})",
        }
    }
