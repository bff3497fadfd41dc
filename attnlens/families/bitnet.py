"""BitNet: the Llama layout with an RMSNorm over the merged heads before `o_proj`, and one over the gated neurons
before `down_proj`.

`attention_premix` is the heads merged, what `attn_sub_norm` receives; the output projection is `o_proj` of that
norm's output (`project_output`), so the premix's per-head slices do not add up linearly to the attention output.
In the MLP, `mlp_activation` is `act_fn(gate_proj(x))` and `mlp_neurons` what `down_proj` receives:
`ffn_sub_norm(mlp_activation * up_proj(x))` (`mlp_arithmetic`), so the MLP's output is `down_proj(mlp_neurons)`.

The checkpoint's ternary weights (BitNet b1.58) are quantized by transformers' BitNet integration when loaded; the
values are read from the modules as they run either way.

vLLM 0.32 has no BitNet class and runs it through its Transformers backend (transformers' own modules, vLLM's kernel
as the attention function); relu2 has no fused act-and-mul kernel there, so the MLP is not fused and every eager
location holds.
"""

from dataclasses import replace

from ..family import Tiny
from ..locations import ModuleInput
from ..parts import identities
from ..parts.mirrored import transformers_backend
from .llama import Llama


class BitNet(Llama):
    model_types = ("bitnet",)
    tiny = Tiny("BitNetConfig", "BitNetForCausalLM", {})
    # head size 32 (vLLM's CPU kernels); attn_sub_norm spans hidden_size, so the heads must fill it
    vllm = transformers_backend(("bitnet",), tiny={"hidden_size": 128})

    def locations(self):
        return {**super().locations(), "attention_premix": ModuleInput("attn_sub_norm")}

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            common = super().mlp_arithmetic(mlp)  # the Llama MLP's, with the sub-norm over the product
            return replace(
                common,
                neurons=lambda x, activation: mlp.ffn_sub_norm(activation * mlp.up_proj(x)),
                says=(common.says[0], "ffn_sub_norm(activation * up(mlp input))", common.says[2]),
            )

        def project_output(self, module, premix):
            return module.o_proj(module.attn_sub_norm(premix))

    kind_notes = {
        "*": {
            "attention_premix": "the heads merged, what attn_sub_norm (an RMSNorm over all heads together) "
            "receives; o_proj receives that norm's output",
            "mlp_neurons": "what down_proj receives: ffn_sub_norm(mlp_activation * up_proj(x)), the gated "
            "product RMS-normalised over the neurons",
        }
    }
