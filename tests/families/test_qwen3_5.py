"""Qwen3_5, Qwen3_5Multimodal (attnlens/families/qwen3_5.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT
from identities import close, saved_for

import attnlens
from attnlens.models import char_tokenizer, tiny_model


def test_a_released_qwen3_5_checkpoint_loads_as_the_text_model(tmp_path):
    """A "qwen3_5" checkpoint (text and vision configs) loads through AutoModelForCausalLM as the text model, on the
    text config, so the text family serves it, with its paths and values."""
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


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_moe"])
def test_the_released_composite_as_an_object_is_served_under_language_model(case, tmp_path):
    """The composite class handed over as an object (a vision tower beside model.language_model): its own family,
    whose values are the text model's, as the same weights loaded from the checkpoint as the text model give them."""
    composite = attnlens.StandardizedTransformer(tiny_model(case, checkpoint=True), tokenizer=char_tokenizer())
    assert type(composite._module).__name__.endswith("ForConditionalGeneration")
    assert composite.family.model_types == (case,) and composite.family.layers == "model.language_model.layers"
    composite._module.save_pretrained(tmp_path)
    text = attnlens.StandardizedTransformer(str(tmp_path), tokenizer=char_tokenizer(), attn_implementation="eager")
    assert not type(text._module).__name__.endswith("ForConditionalGeneration")
    found = []
    for model in (composite, text):
        with torch.no_grad(), model.trace(PROMPT):
            full = next(
                layer
                for layer in range(model.num_layers)
                if model.support(layer)["self_attn.attention_probabilities"] is None
            )
            found.append([model.layers[full].self_attn.attention_probabilities.save(), model.logits.save()])
    assert all(close(a, b) for a, b in zip(*found))
