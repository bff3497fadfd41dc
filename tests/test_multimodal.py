"""Multimodal causal LMs (Gemma 3, Gemma 4): the composite serves its language model.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
from conftest import tiny


@pytest.mark.parametrize(("case", "text"), [("gemma3", "gemma3_text"), ("gemma4", "gemma4_text")])
def test_multimodal_types_serve_their_language_model(case, text):
    """`AutoModelForCausalLM` builds the ...ForConditionalGeneration class: the same blocks under
    model.language_model, with the text config's windows; the text family's values, unchanged."""
    model, plain = tiny(case), tiny(text)
    assert type(model._module).__name__.endswith("ForConditionalGeneration")
    assert model.family.layers == "model.language_model.layers"
    assert (
        [model.family.score_function().sliding_window(model.config, i) for i in range(3)]
        == [plain.family.score_function().sliding_window(plain.config, i) for i in range(3)]
        != [None] * 3
    )
    notes, text_notes = model.support(0).notes, plain.support(0).notes
    assert notes["self_attn.attention_probabilities"].startswith(text_notes["self_attn.attention_probabilities"])
    assert "image" in notes["self_attn.attention_probabilities"]
