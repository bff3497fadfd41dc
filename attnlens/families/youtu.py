"""Youtu: DeepSeek-V2's multi-head latent attention (`attnlens.families.deepseek_v2.LatentAttention`) in a block with
a dense MLP on every layer."""

from ..family import Tiny, VLLMLayout
from .deepseek_v2 import LatentAttention

#: The latent sizes every tiny MLA recipe shares (the survey's, DeepSeek-V2's).
LATENT_TINY = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


class Youtu(LatentAttention):
    model_types = ("youtu",)
    vllm = VLLMLayout(
        refusal="vLLM 0.32 did not run Youtu on CPU (a GPU was not tried): it has no class for YoutuForCausalLM "
        "and runs it through its Transformers backend, which serves its latent attention with vLLM's MLA kernel, "
        'whose metadata rejects the head size it is handed: "Head dimension 8 is not supported by MLA" on the tiny '
        'checkpoint, "Head dimension 64 ..." with kv_lora_rank 512 and qk_rope_head_dim 64 (what vLLM\'s own '
        "DeepSeek-V2 runs on CPU); the transformers engine serves the family",
    )
    tiny = Tiny("YoutuConfig", "YoutuForCausalLM", LATENT_TINY)
