"""GPT-NeoX (Pythia): one fused `query_key_value` projection laid out per head ([q|k|v] for each head in turn),
partial rotary embedding, and a parallel block by default (`use_parallel_residual=True`).

The projection is viewed as [batch, heads, seq, 3 * head_dim] and chunked into queries, keys and values, so the values
are a chunk of it (a view: an in-place edit writes into the projection's output, which nothing else reads). Queries
and keys are read after the rotary embedding (over the first `rotary_pct` of each head), which makes them new
tensors. In the parallel block
attention reads `input_layernorm(x)` and the MLP reads `post_attention_layernorm(x)` of the same block input `x`, and
both outputs join `x` in one sum: `layer_mid` is unavailable and `mlp_norm_output` is `post_attention_layernorm`'s
output. With `use_parallel_residual=False` the block is sequential and `layer_mid` is what that norm receives.
"""

from ..family import Family, Tiny
from ..locations import ModuleOutput
from ..parts.fused import FusedQKV
from ..parts.mirrored import transformers_backend
from ..parts.parallel import PARALLEL_NO_MID, parallel_locations
from ..parts.sizes import Sizes


class GPTNeoX(Family):
    model_types = ("gpt_neox",)
    vllm = transformers_backend(("gpt_neox",), tiny={"hidden_size": 128})  # head size 32
    tiny = Tiny(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        {"rotary_pct": 0.25, "num_key_value_heads": None},
        layouts={"sequential": {"use_parallel_residual": False}},
    )
    layers = "gpt_neox.layers"
    embed_tokens = "gpt_neox.embed_in"
    final_norm = "gpt_neox.final_layer_norm"
    attention = "attention"
    output_projection = "dense"
    activation = "act"
    down_projection = "dense_4h_to_h"
    fused_qkv = FusedQKV("query_key_value", "groups")
    absent = {
        "layer_mid": PARALLEL_NO_MID.format(norms="input_layernorm for attention, post_attention_layernorm for the MLP")
    }  # parallel layout only
    sizes = Sizes(num_kv_heads=("config.num_attention_heads",), head_dim=("head_size",))

    def layer_kind(self, config, layer):
        return frozenset({"parallel"}) if getattr(config, "use_parallel_residual", True) else frozenset()

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        return parallel_locations(locations, ModuleOutput(self.mlp_norm)) if "parallel" in kind else locations

    kind_notes = {
        "parallel": {
            "mlp_norm_output": "a parallel block: post_attention_layernorm of the block input (not of a residual after "
            "attention)",
        }
    }
