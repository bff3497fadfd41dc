"""dots.3 Note: DeepSeek-V3.2's latent attention on indexed layers, alternating with sliding-window latent attention
of other sizes, with a sigmoid gate per head and token, and normed, rescaled latents.

- `config.layer_types`: `indexed_attention` layers are sparse (a lightning indexer chooses `index_topk` keys per
  query, see DeepSeek-V3.2); `sliding_attention` layers see their last `sliding_window` keys and have their own head
  count and sizes (`per_layer_config`, the checkpoint's `swa_*`), read per layer from each attention module.
- The query and key/value latents are normed, then multiplied by `sqrt(hidden_size / rank)`; the shared rotary slice
  of the keys is normed too (`k_rope_only_layernorm`) before the interleaved rotary embedding. Queries and keys are
  read after all of it, as the attention function receives them.
- Each head's output is multiplied by `sigmoid(g_proj(hidden))`, one scalar per head and token, before `o_proj`:
  `attention_gate` is that sigmoid broadcast over the head's `v_head_dim` channels (read-only in place; an assigned
  gate must be constant along the channels).

"dots3_note" (with vision and audio towers) loads through `AutoModelForCausalLM` as the same text class, so both
types map here.
"""

from ..family import VLLMLayout
from ..locations import insert_after
from ..parts.gates import head_scalar_gate
from .deepseek_v32 import INDEXER_TINY, DeepseekV32
from .youtu import LATENT_TINY

SLIDING = {
    "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 2,
    "swa_q_lora_rank": 32,
    "swa_kv_lora_rank": 16,
    "swa_head_dim": 24,
    "swa_qk_nope_head_dim": 16,
    "swa_v_head_dim": 8,
}


class Dots3Note(DeepseekV32):
    model_types = ("dots3_note_text", "dots3_note")
    tiny = (
        "Dots3NoteTextConfig",
        "Dots3NoteForCausalLM",
        {
            **LATENT_TINY,
            **INDEXER_TINY,
            **SLIDING,
            "head_dim": 24,
            "sliding_window": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "layer_types": ["indexed_attention", "sliding_attention", "indexed_attention"],
            "mlp_layer_types": ["dense", "sparse", "dense"],
        },
    )

    vllm = VLLMLayout(
        refusal="vLLM 0.32 cannot load a transformers dots.3 Note checkpoint: the transformers it pins (5.19) has "
        'no dots3_note_text ("The checkpoint you are trying to load has model type `dots3_note_text` but '
        "Transformers does not recognize this architecture\"), and its own Dots3NoteForCausalLM reads its authors' "
        "flat config, not transformers' dots3_note, whose text model is nested: \"The text_config extracted from "
        'the model config does not have `num_attention_heads` attribute"; its indexed layers are DeepSeek Sparse '
        "Attention besides, which vLLM does not run on CPU (DeepSeek-V3.2); the transformers engine serves the family"
    )

    def layer_config(self, config, layer):
        return config.per_layer_config[layer]

    def indexed(self, config, layer):
        return config.layer_types[layer] == "indexed_attention"

    def locations(self):
        gate = head_scalar_gate("gate_sigmoid_0", "gate.sigmoid()", trailing=True)
        return insert_after(super().locations(), "attention_head_outputs", "attention_gate", gate)

    kind_notes = {
        "*": {
            "attention_queries": "from the normed query latent times sqrt(hidden_size / q_lora_rank); the "
            "rotary slice after the interleaved rotary embedding",
            "attention_head_outputs": "the mix before the output gate: times attention_gate, merged, is the premix",
            "attention_gate": "sigmoid(g_proj(hidden)): one scalar per head and token, broadcast over the "
            "head's v_head_dim channels",
        }
    }
