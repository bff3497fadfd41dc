"""Phi-3.5-MoE (PhiMoE): the Llama layout with LayerNorms (with biases) for norms, biased projections where
`attention_bias` says, a biased LM head where `lm_head_bias` says, and a sparse mixture of experts as every MLP
(routed by sparsemixer, two experts a token), so no activation or neuron tensor exists.

vLLM's own PhiMoE (phimoe.py, `PhiMoEForCausalLM`, the name released checkpoints carry; a checkpoint transformers
saves says `PhimoeForCausalLM`, which vLLM sends to its Transformers backend, where the router fails, so
`StandardizedVLLM` asks for vLLM's class: `vllm.architecture`) names the MoE block `block_sparse_moe` (renamed
`mlp`), always builds the q/k/v, output and LM-head biases, and passes no sliding window to its kernels. Its blocks
return `(hidden_states, residual)` with the whole stream first and the midpoint second, and take the previous
block's midpoint as an argument they ignore: the residual values are the block's own input and output.
"""

from dataclasses import replace

from ..family import Tiny
from ..locations import ModuleArgument
from ..locations.vllm import batched
from ..parts.moe import SparseMoE, moe_absent
from ..parts.vllm import unpaired_locations
from .llama import Llama


def _phimoe_vllm_locations(family):
    # called (positions, hidden_states, residual): that residual is the previous block's midpoint, not the stream
    return {
        **unpaired_locations(family, Llama.vllm.locations(family)),
        "layer_input": batched(ModuleArgument("", 1)),
    }


def _no_window(family, config, layer):
    return None  # vLLM's PhiMoEAttention builds its kernel without one


class PhiMoE(SparseMoE, Llama):
    model_types = ("phimoe",)
    # vLLM's PhiMoE always builds the biases (and routes two experts a token): the tiny checkpoint has them
    tiny = Tiny(
        "PhimoeConfig",
        "PhimoeForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": True, "lm_head_bias": True},
    )
    absent = moe_absent("PhimoeExperts")
    vllm = replace(
        Llama.vllm,
        model_types=("phimoe",),  # tests_vllm
        names={"mlp": "block_sparse_moe"},
        locations=_phimoe_vllm_locations,
        architecture="PhiMoEForCausalLM",
        window=_no_window,
        tiny={"hidden_size": 128},  # vLLM's head size is hidden_size // num_attention_heads (32 and up on CPU)
    )

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        window = self.score_function().sliding_window(config, layer)
        if engine == "vllm" and window is not None:
            notes["attention_probabilities"] = (
                f"full attention on vLLM, where transformers slides over the last {window} keys: vLLM's PhiMoE "
                f"passes no sliding window to its kernels"
            )
        return notes
