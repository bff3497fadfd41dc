"""RecurrentGemma (Griffin): RG-LRU recurrent blocks with local sliding-window attention blocks among them, under
Griffin's names.

Each block runs a temporal block (`temporal_block`, renamed `self_attn`) after `temporal_pre_norm` and an MLP
(`mlp_block`, renamed `mlp`) after `channel_pre_norm`. On attention blocks the temporal block is the common attention
(grouped heads, a rotary embedding over the first half of each head) masked to the last `attention_window_size`
keys; on recurrent blocks it is an RG-LRU: a short convolution and a gated linear recurrence multiplied by a GeLU
branch, with no queries, keys or pattern (see `families/hybrid.py`). The first block receives the embeddings times
`sqrt(hidden_size)` (rounded to bfloat16), and `logits` are soft-capped: `tanh(l / logits_soft_cap) *
logits_soft_cap`, as the caller receives them.
"""

from ..family import Family, Tiny, VLLMLayout
from ..parts import scoring
from ..parts.mixers import MixerLayers
from ..parts.sizes import Sizes
from ..parts.vllm import backend_refuses, no_dispatch


class RecurrentGemma(MixerLayers, Family):
    model_types = ("recurrent_gemma",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "RecurrentGemma",
            no_dispatch("0"),
        )
    )
    tiny = Tiny(
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        {"head_dim": 16, "sliding_window": 4, "block_types": ["recurrent", "attention", "recurrent"]},
    )
    padding_changes_values = "the RG-LRU recurrence and its convolution run over the padding"
    final_norm = "model.final_norm"
    attention = "temporal_block"
    attention_norm = "temporal_pre_norm"
    mlp = "mlp_block"
    mlp_norm = "channel_pre_norm"
    mixer = "temporal_block"  # one name for both kinds: the rename is the attention's
    mixer_kind = (
        "an RG-LRU recurrent block: a short convolution and a gated linear recurrence, multiplied by a GeLU branch"
    )
    mixer_premix = (
        "what its linear_out receives is the recurrence's output times the GeLU branch, not attention heads merged"
    )
    sizes = Sizes(num_heads=("num_attention_heads",))

    def is_mixer_layer(self, config, layer):
        # transformers 5.24 names the kinds "linear_attention"/"sliding_attention", 5.19 "recurrent"/"attention"
        return config.layers_block_type[layer] not in ("attention", "sliding_attention")

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return None if self.family.is_mixer_layer(config, layer) else config.attention_window_size

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output; layers[0].layer_input is it times sqrt(hidden_size), "
            "rounded to bfloat16",
            "logits": "soft-capped: tanh(l / {config.logits_soft_cap}) * {config.logits_soft_cap}",
        },
        "!mixer": dict.fromkeys(
            ("attention_queries", "attention_keys"),
            lambda family, config, layer: f"rotated over the first {int(config.head_dim * 0.5)} dims of each head",
        ),
    }
