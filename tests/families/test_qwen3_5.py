"""Qwen3_5 (attnlens/families/qwen3_5.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT
from identities import close, saved_for

import attnlens
from attnlens.models import char_tokenizer, tiny_model


def test_a_full_qwen3_5_checkpoint_loads_as_the_text_model(tmp_path):
    """A "qwen3_5" checkpoint (text and vision configs) loads through AutoModelForCausalLM as the text model."""
    from transformers import Qwen3_5Config

    text = tiny_model("qwen3_5_text")
    text.save_pretrained(tmp_path)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision).save_pretrained(tmp_path)
    model = attnlens.StandardizedTransformer(str(tmp_path), tokenizer=char_tokenizer(), attn_implementation="eager")
    assert model.family.name == "Qwen3_5" and model.config.model_type == "qwen3_5_text"
    with torch.no_grad(), model.trace(PROMPT):
        gate = model.layers[2].self_attn.attention_gate.save()
        logits = model.logits.save()
    assert gate.shape == (1, len(PROMPT), 4, 16)
    assert close(logits, saved_for("qwen3_5_text")["logits"])
