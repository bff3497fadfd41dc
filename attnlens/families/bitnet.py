"""BitNet: the Llama layout with an RMSNorm over the merged heads before `o_proj`, and one over the gated neurons
before `down_proj`.

`attention_premix` is the heads merged, what `attn_sub_norm` receives; the output projection is `o_proj` of that
norm's output (`project_output`), so the premix's per-head slices do not add up linearly to the attention output.
In the MLP, `mlp_neurons` is what `down_proj` receives: `ffn_sub_norm(act_fn(gate_proj(x)) * up_proj(x))`.

The checkpoint's ternary weights (BitNet b1.58) are quantized by transformers' BitNet integration when loaded; the
values are read from the modules as they run either way.
"""

from ..locations import ModuleInput
from .llama import Llama

SUB_NORM = ("BitNet normalises act_fn(gate_proj(x)) * up_proj(x) (ffn_sub_norm, an RMSNorm over the neurons) before "
            "down_proj, so mlp_neurons (what down_proj receives) is not the activation times the up projection, the "
            "identity attnlens checks the activation with; not served until the checks know the sub-norm")


class BitNet(Llama):
    model_types = ("bitnet",)
    tiny = ("BitNetConfig", "BitNetForCausalLM", {})
    absent = {**Llama.absent, "mlp_activation": SUB_NORM}

    def locations(self):
        locations = super().locations()
        del locations["mlp_activation"]
        return {**locations, "attention_premix": ModuleInput("attn_sub_norm")}

    def project_output(self, module, premix):
        return module.o_proj(module.attn_sub_norm(premix))

    def notes(self, config, layer, engine="eager"):
        return {**super().notes(config, layer, engine),
                "attention_premix": "the heads merged, what attn_sub_norm (an RMSNorm over all heads together) "
                                    "receives; o_proj receives that norm's output",
                "mlp_neurons": "what down_proj receives: ffn_sub_norm(act_fn(gate_proj(x)) * up_proj(x))"}
