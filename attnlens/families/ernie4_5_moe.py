"""ERNIE 4.5 MoE: ERNIE 4.5's attention (the Llama layout, its rotary embedding rotating interleaved channel pairs) with
a sparse mixture of experts plus a dense shared MLP (`mlp.shared_experts`) on the layers from
`moe_layer_start_index` to `moe_layer_end_index`, every `moe_layer_interval`-th; the others keep a dense gated MLP and
serve every MLP value (moe.py).

vLLM's Ernie4_5_MoeForCausalLM (ernie45_moe.py) is laid out as its Llama: the Llama locations there too.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .ernie4_5 import Ernie4_5


class Ernie4_5Moe(SparseMoE, Ernie4_5):
    model_types = ("ernie4_5_moe",)
    # moe_layer_start_index defaults to 1: layer 0 keeps a dense MLP, so both kinds of layer are tested.
    tiny = Tiny(
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "moe_num_shared_experts": 1},
    )
    absent = moe_absent(
        "Ernie4_5_MoeExperts", ", plus the shared experts (mlp.shared_experts, a dense MLP reading the same input)"
    )
    vllm = replace(
        Ernie4_5.vllm,
        model_types=("ernie4_5_moe",),
        tiny={"hidden_size": 128},  # its config has no head_dim: vLLM's head size is hidden_size // heads
    )

    def moe_layer(self, config, layer):
        # Ernie4_5_MoeDecoderLayer's own rule for building a sparse block.
        start, end = config.moe_layer_start_index, config.moe_layer_end_index
        return start <= layer <= end and (layer + 1) % config.moe_layer_interval == 0
