"""Llama 4: chunked attention on rotary layers, NoPE layers with temperature-tuned queries, an L2 QK-norm, and MoE
feed-forwards (a shared expert beside routed experts) interleaved with dense ones.

- Layer kinds by `config.no_rope_layers` (1: the layer applies the rotary embedding, 0: it is a NoPE layer) and
  `config.layer_types`: rotary layers are `chunked_attention` when `attention_chunk_size` is set, each query seeing
  only the earlier keys of its own chunk of `attention_chunk_size` positions (counted from the first real token);
  NoPE layers attend to every earlier key. The score function reproduces the chunks on a prefill.
- Rotary layers apply the rotary embedding as complex multiplication of adjacent channel pairs, then (with
  `use_qk_norm`) an L2 norm without weights (`qk_norm`) to queries and keys: both are read after it.
- NoPE layers with `attn_temperature_tuning` multiply each query by `1 + attn_scale * log1p(floor((p + 1) /
  floor_scale))` at its position p; the queries are read after that scaling, as the attention function receives them.
- The block's MLP is `feed_forward` (renamed `mlp`). Dense layers' activation is `activation_fn`. MoE layers
  (`config.moe_layers`) run every routed expert on every token (inputs pre-multiplied by the router's sigmoid score,
  zero for experts not chosen) and add the shared expert; the block returns `(output, router logits)` with the output
  flat, `[batch * seq, hidden]`: `mlp_output` is that output viewed as `[batch, seq, hidden]`.
"""

from dataclasses import dataclass

import torch

from ..family import Family, VLLMLayout, released_tiny
from ..locations import Derived, ModuleOutput, child
from ..locations.cache import with_cache
from ..parts import identities, scoring
from ..parts.moe import SparseMoE
from ..parts.multimodal import VLLM_LANGUAGE_MODEL, LanguageModelOf, released_vllm

MOE_REASON = (
    "a mixture-of-experts layer: mlp.experts forms act(gate) * up for every expert over every token, "
    "[num_experts, batch * seq, intermediate], on inputs pre-multiplied by the router's sigmoid score (zero "
    "for experts not chosen), and the shared expert (mlp.shared_expert) forms its own; no single [batch, "
    "seq, intermediate] tensor exists. The dense layers (not in config.moe_layers) serve it"
)


@dataclass(frozen=True)
class TokensOutput(ModuleOutput):
    """A module's output flattened to `[batch * seq, hidden]` (an item of a tuple), viewed as its input's layout."""

    def read(self, envoy):
        shape = child(envoy, self.module).input.shape
        return super().read(envoy).view(shape)

    def write(self, envoy, value):
        super().write(envoy, value.flatten(0, -2))


def _interleaved(envoy, heads):
    """vLLM's query or key channels per head (even ones, then odd ones) in transformers' order (adjacent pairs)."""
    half = heads.shape[-1] // 2
    return torch.stack((heads[..., :half], heads[..., half:]), dim=-1).flatten(-2)


def _deinterleaved(envoy, old, new):
    return torch.cat((new[..., 0::2], new[..., 1::2]), dim=-1)


def _in_transformers_order(source):
    return Derived(
        source,
        _interleaved,
        _deinterleaved,
        in_place=False,
        note="vLLM permutes each head's query and key channels at load (even ones, then odd ones: its "
        "rotary kernel rotates halves); served in transformers' order (adjacent pairs), a copy: assign "
        "it to edit",
        why_not="it is a copy in transformers' channel order (vLLM holds the channels permuted)",
    )


def _llama4_vllm_locations(family):
    locations = with_cache(Family.vllm.locations(family))  # vLLM caches the keys permuted, too
    permuted = ("attention_cache_keys", "attention_queries", "attention_keys")
    return {name: _in_transformers_order(found) if name in permuted else found for name, found in locations.items()}


class Llama4(SparseMoE, Family):
    model_types = ("llama4_text",)
    tiny = (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "head_dim": 16,
            "intermediate_size_mlp": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_layers": [0, 1],
            "no_rope_layers": [1, 0, 1],
            # chunks of 4 positions, so the 18-token test prompt crosses four chunk boundaries
            "attention_chunk_size": 4,
            "layer_types": ["chunked_attention", "full_attention", "chunked_attention"],
        },
    )
    # The NoPE layers' temperature tuning binds only past floor_scale (8192) positions; test_flagships.py makes it bind
    # on the test prompt. (It counts padded positions, so left padding changes it: the padded-batch tests can't use it.)
    mlp = "feed_forward"
    activation = "activation_fn"
    absent = {"mlp_activation": MOE_REASON, "mlp_neurons": MOE_REASON}
    # vLLM (llama4.py): Llama's locations under the same names. It places MoE layers by interleave_moe_layer_step
    # (every step-th layer) and ignores moe_layers, so the checkpoint states both alike; its chunked layers run
    # ChunkedLocalAttention, whose chunk must be a multiple of the KV cache's block size (tests_vllm sets 32).
    vllm = VLLMLayout(
        model_types=("llama4_text",),
        tiny={
            "head_dim": 32,
            "moe_layers": [1],
            "interleave_moe_layer_step": 2,
            "attention_chunk_size": 32,
            "num_experts_per_tok": 1,
        },  # vLLM applies the router weight on the input for top-1 only
        locations=_llama4_vllm_locations,
    )

    def moe_layer(self, config, layer):
        return layer in config.moe_layers

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if (
            "moe" in kind and engine == "transformers"
        ):  # vLLM's MoE block returns its flat output alone, as its MLP does
            locations["mlp_output"] = TokensOutput("", 0)
        return locations

    class Identities(identities.Identities):
        def mlp_forward(self, mlp, mlp_input):
            return super().mlp_forward(mlp, mlp_input).view(mlp_input.shape)

    @staticmethod
    def rotary(config, layer: int) -> bool:
        return bool(config.no_rope_layers[layer])

    def chunk(self, config, layer: int) -> int | None:
        """The chunk size of `layer`'s attention, or None where it sees every earlier key."""
        return config.attention_chunk_size if config.layer_types[layer] == "chunked_attention" else None

    class ScoreFunction(scoring.ScoreFunction):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
            mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            size = self.family.chunk(config, layer)
            if size is None:
                return mask
            # chunks count from each row's first real token (transformers' chunked_overlay, with left padding)
            keys = torch.arange(num_keys, device=mask.device)
            start = (
                torch.zeros(1, dtype=torch.long, device=mask.device)
                if key_mask is None
                else (key_mask.to(mask.device).long().cumsum(-1) == 0).sum(-1)
            )
            chunks = (keys[None] - start[:, None]).div(size, rounding_mode="floor")  # [batch or 1, key]
            same = chunks[:, None, num_keys - num_queries :, None] == chunks[:, None, None, :]
            return torch.where(same, mask, torch.finfo(dtype).min)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        size = self.chunk(config, layer)
        if size is not None:
            notes["attention_probabilities"] = (
                f"chunked attention: each query sees only the earlier keys of its own chunk of {size} positions; "
                f"under generate the cache keeps only the last {size} keys, and the family's score function, which "
                f"places keys from position 0, matches the decode steps only within the first chunk"
            )
        if self.rotary(config, layer):
            rotated = "after the rotary embedding (complex multiplication of adjacent channel pairs)"
            if config.use_qk_norm:
                rotated += " and qk_norm (an L2 norm without weights)"
            notes["attention_queries"] = notes["attention_keys"] = rotated
        else:
            notes["attention_keys"] = "a NoPE layer: no rotary embedding and no QK-norm"
            notes["attention_queries"] = notes["attention_keys"]
            if config.attn_temperature_tuning:
                notes["attention_queries"] += (
                    f"; temperature-tuned: each query times 1 + {config.attn_scale:g} * log1p(floor((p + 1) / "
                    f"{config.floor_scale})) at its position p, as the attention function receives it; p counts "
                    f"the batch's positions, left padding included (transformers' arange), so padding changes it"
                )
        return notes

    kind_notes = {
        "moe": {
            "mlp_output": "the MoE block's output (routed experts plus the shared expert), flat [batch * seq, hidden] "
            "in the forward, viewed as [batch, seq, hidden]; in-place edits land",
        }
    }


class Llama4Multimodal(LanguageModelOf, Llama4):
    """Released Llama 4 checkpoints ("llama4", `Llama4ForConditionalGeneration`: Scout, Maverick) as a composite
    object, and on vLLM (its mllama4.py, the text class as `language_model`): the text model under `language_model`.
    Loaded from the checkpoint, transformers builds the text model (`Llama4ForCausalLM` on the text config), served by
    `Llama4`. (The composite object's own forward on text fails in transformers 5.24: "'MoeCausalLMOutputWithPast'
    object has no attribute 'image_outputs'"; loading the checkpoint avoids it.)"""

    # transformers' Llama4ForConditionalGeneration holds its Llama4ForCausalLM whole as `language_model`, as vLLM does
    layers, embed_tokens, final_norm = (VLLM_LANGUAGE_MODEL[part] for part in ("layers", "embed_tokens", "final_norm"))
    model_types = ("llama4",)
    tiny = released_tiny(
        "Llama4Config",
        "Llama4ForConditionalGeneration",
        Llama4,
        {
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": 28,
            "patch_size": 14,
            "vision_output_dim": 64,
            "projector_input_dim": 64,
            "projector_output_dim": 64,
        },
    )
    vllm = released_vllm(Llama4, "llama4", tiny)  # vLLM's mllama4
