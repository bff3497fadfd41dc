"""Qwen3_5, Qwen3_5Multimodal (attnlens/families/qwen3_5.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for

import attnlens
from attnlens.models import char_tokenizer, tiny_model


def test_a_released_qwen3_5_checkpoint_loads_as_the_text_model(tmp_path):
    """A "qwen3_5" checkpoint (text and vision configs) loads through AutoModelForCausalLM as the text model, on the
    text config: its own family, with the text family's paths and values."""
    from transformers import Qwen3_5Config

    text = tiny_model("qwen3_5_text")
    text.save_pretrained(tmp_path)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision).save_pretrained(tmp_path)
    model = attnlens.StandardizedTransformer(str(tmp_path), tokenizer=char_tokenizer(), attn_implementation="eager")
    assert model.family.name == "Qwen3_5Multimodal" and model.config.model_type == "qwen3_5_text"
    with torch.no_grad(), model.trace(PROMPT):
        gate = model.layers[2].self_attn.attention_gate.save()
        logits = model.logits.save()
    assert gate.shape == (1, len(PROMPT), 4, 16)
    assert close(logits, saved_for("qwen3_5_text")["logits"])


@pytest.mark.parametrize(
    ("case", "text"), [("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")]
)
def test_the_tiny_released_checkpoint_is_what_transformers_loads_from_it(case, text):
    """The recipe saves the composite class (model.language_model.*, a vision tower); the tiny model is the text class
    AutoModelForCausalLM loads from it, under the released type's family."""
    model = tiny(case)
    assert type(tiny_model(case)).__name__.endswith("ForConditionalGeneration")
    assert type(model._module).__name__ == text and model.family.model_types == (case,)
