"""MiniCPM3: DeepSeek-V2's multi-head latent attention with a dense MLP, and MiniCPM's three scales.

Each sublayer's output is scaled by `scale_depth / sqrt(num_hidden_layers)` before the residual add, so
`layer_mid = layer_input + s * attention_output` and `layer_output = layer_mid + s * mlp_output`. `embeddings` is the
scaled embedding module's output (times `scale_emb`, what the first block receives), and the final norm's output is
divided by `hidden_size / dim_model_base` before the LM head.

vLLM's MiniCPM3 (model_executor/models/minicpm3.py) expands the latent into per-head keys and values itself and runs
vLLM's plain attention kernel on them, not its MLA kernel: one key/value head per query head, of `qk_head_dim`
channels, the values zero-padded from `v_head_dim` to that width and the output cut back. So queries and keys are the
kernel's, the values its input cut to `v_head_dim`, the head outputs what `o_proj` receives split in `v_head_dim`
heads; the rebuilt pattern is read-only (an edited pattern's head outputs would be recomputed from the padded values
at a width `o_proj` does not take). The blocks pass the stream as one tensor, as vLLM's Granite's (`granite.py`).
"""

import math
from dataclasses import dataclass, replace

from ..family import Family
from ..locations import Derived, Location, ModuleInput
from ..locations.vllm import KernelInput, RebuiltPattern
from ..parts import identities
from .deepseek_v2 import LatentAttention
from .granite import unpaired_locations
from .youtu import LATENT_TINY

PADDED = (
    "vLLM's MiniCPM3 pads each head's values with zeros from v_head_dim to qk_head_dim for its kernel, so an "
    "edited pattern's head outputs cannot be recomputed at the width o_proj takes; edit the queries, keys, "
    "values or head outputs instead"
)


@dataclass(frozen=True)
class UnpaddedPattern(RebuiltPattern):
    """The rebuilt pattern of a layer whose kernel takes padded values: read-only."""

    in_place = False
    writable = False
    why_not = PADDED


def _v_width(envoy):
    return envoy.interleaver.attnlens.of(envoy).config.v_head_dim


def _unpadded(envoy, heads):
    return heads[..., : _v_width(envoy)]


def _v_heads(envoy, flat):
    return flat.unflatten(-1, (-1, _v_width(envoy)))[None]


def _v_merged(envoy, old, new):
    return new[0].flatten(-2)


def _minicpm3_vllm_locations(family) -> dict[str, Location]:
    """vLLM's plain attention kernel on keys and values expanded from the latent (module docstring)."""
    locations = unpaired_locations(family, Family.vllm.locations(family))  # the plain kernel's, not MLA's
    kernel = family.vllm.kernel
    values = Derived(
        KernelInput(kernel, 2),
        _unpadded,
        None,
        in_place=False,
        note="what vLLM's kernel receives, cut from qk_head_dim (zero-padded) to v_head_dim",
        why_not="it is the kernel's padded values cut to v_head_dim, a copy",
    )
    heads = Derived(
        ModuleInput(family.output_projection),
        _v_heads,
        _v_merged,
        note="the output projection's input, split into v_head_dim heads",
    )
    return {
        **locations,
        "attention_values": values,
        "attention_head_outputs": heads,
        "attention_scores": UnpaddedPattern(kernel, "scores"),
        "attention_probabilities": UnpaddedPattern(kernel, "probabilities"),
    }


class MiniCPM3(LatentAttention):
    model_types = ("minicpm3",)
    # scales far from 1, so a family ignoring one fails the identities
    tiny = ("MiniCPM3Config", "MiniCPM3ForCausalLM", {**LATENT_TINY, "scale_depth": 0.5, "dim_model_base": 16})
    # vLLM's CPU kernel takes heads of 32 and up: qk_head_dim 32, values of 16 padded to it
    vllm = replace(
        LatentAttention.vllm,
        model_types=("minicpm3",),
        kernel="attn",  # vLLM's plain attention kernel, not the MLA one
        tiny={"qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16},
        locations=_minicpm3_vllm_locations,
    )

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            # transformers' block holds the scale; vLLM's computes it from its config each time
            scale = getattr(block, "residual_scale", None)
            if scale is None:
                scale = block.config.scale_depth / math.sqrt(block.config.num_hidden_layers)
            return stream + update * scale

    def notes(self, config, layer, engine="transformers"):
        scale = config.scale_depth / math.sqrt(config.num_hidden_layers)
        # vLLM rotates flat queries and keys here (no MLA kernel), so its CPU rotary is right: eager's notes
        latent = {
            name: note
            for name, note in super().notes(config, layer, "transformers").items()
            if name in ("attention_queries", "attention_keys")
        }
        return {
            **super().notes(config, layer, engine),
            **latent,
            "layer_mid": f"layer_input + {scale:g} * attention_output (scale_depth / sqrt(num_hidden_layers))",
            "layer_output": f"layer_mid + {scale:g} * mlp_output (scale_depth / sqrt(num_hidden_layers))",
            "embeddings": f"the scaled embedding's output: token embeddings times scale_emb ({config.scale_emb:g})",
            "logits": f"the LM head applied to final_norm_output / {config.hidden_size / config.dim_model_base:g} "
            f"(hidden_size / dim_model_base)",
        }
