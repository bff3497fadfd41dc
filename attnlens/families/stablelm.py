"""StableLM: partial rotary embedding, optional per-head QK LayerNorm, and a block that is sequential by default and
parallel with `use_parallel_residual`.

The rotary embedding covers the first `partial_rotary_factor` of each head; with `qk_layernorm` one LayerNorm per head
normalises its queries and keys before it, and the queries and keys are read after both. With `use_parallel_residual`
the block has no `post_attention_layernorm`: attention and the MLP read the same `input_layernorm` output and both
outputs join the block input in one sum, so `layer_mid` is unavailable and `mlp_norm_output` is the shared norm
output as the MLP receives it.

vLLM's StableLM implements the sequential block without QK LayerNorm only, passing the residual stream between blocks
as one tensor (no `(hidden, residual)` pair); it refuses the other two layouts' checkpoints when it loads them.
"""

from ..family import Family, Tiny, VLLMLayout
from ..locations import ModuleInput
from ..parts.parallel import PARALLEL_NO_MID, parallel_locations, shared_attention_norm
from ..parts.vllm import unpaired_locations


def _stablelm_vllm_locations(family):
    return unpaired_locations(family, Family.vllm.locations(family))


class StableLm(Family):
    model_types = ("stablelm",)
    tiny = Tiny(
        "StableLmConfig",
        "StableLmForCausalLM",
        {"partial_rotary_factor": 0.25},
        layouts={"qk_layernorm": {"qk_layernorm": True}, "parallel": {"use_parallel_residual": True}},
    )
    absent = {"layer_mid": PARALLEL_NO_MID.format(norms="one shared input_layernorm")}  # parallel layout only
    vllm = VLLMLayout(
        locations=_stablelm_vllm_locations,
        model_types=("stablelm",),
        tiny={"hidden_size": 128, "head_dim": 32},  # vLLM's head size is hidden_size // num_attention_heads
    )

    def layer_kind(self, config, layer):
        return frozenset({"parallel"}) if getattr(config, "use_parallel_residual", False) else frozenset()

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        return parallel_locations(locations, ModuleInput(self.mlp)) if "parallel" in kind else locations

    kind_notes = {"parallel": {"mlp_norm_output": shared_attention_norm}}
