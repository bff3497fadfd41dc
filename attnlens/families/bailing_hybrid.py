"""Bailing Hybrid (Ling 2.5): Kimi Linear's hybrid of Kimi Delta Attention and latent attention, with a rotary
embedding on the latent-attention layers and a sigmoid gate per head and token on their output.

Full-attention layers are DeepSeek-V3's latent attention (interleaved rotary embedding on the shared key slice);
each head's output is multiplied by `sigmoid(g_proj(hidden))`, one scalar per head and token, before `o_proj`:
`attention_gate` is that sigmoid broadcast over the head's `v_head_dim` channels. Linear-attention layers are Kimi
Delta Attention (see Kimi Linear), whose output gate lives inside `o_norm`.
"""

from ..family import Tiny, VLLMLayout
from ..locations import insert_after
from ..parts.gates import head_scalar_gate
from .deepseek_v2 import DeepseekV2
from .kimi_linear import MOE, DeltaHybrid
from .youtu import LATENT_TINY


class BailingHybrid(DeltaHybrid, DeepseekV2):
    model_types = ("bailing_hybrid",)
    tiny = Tiny(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        {
            **LATENT_TINY,
            **MOE,
            "q_lora_rank": None,
            "linear_head_dim": 16,
            "linear_num_heads": 4,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        },
    )
    label = "Bailing Hybrid"
    vllm = VLLMLayout(
        refusal="vLLM 0.32 cannot load a transformers bailing_hybrid checkpoint: the transformers it pins (5.19) has "
        'no BailingHybridConfig ("The checkpoint you are trying to load has model type `bailing_hybrid` but '
        'Transformers does not recognize this architecture"), also when asked for its BailingMoeV3ForCausalLM '
        "(hf_overrides), the Kimi Delta Attention and latent-attention model, which reads its authors' config "
        "(layer_group_size, not layer_types); its BailingMoeV2_5ForCausalLM is another model (lightning linear "
        "attention with a decay per head, not Kimi Delta Attention); the transformers engine serves the family"
    )

    def locations(self):
        gate = head_scalar_gate("torch_sigmoid_0", "torch.sigmoid(self.g_proj", trailing=False)
        return insert_after(super().locations(), "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "!mixer": {
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid(g_proj(hidden)): one scalar per head and token, broadcast over the head's "
            "v_head_dim channels",
        }
    }
