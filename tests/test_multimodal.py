"""Multimodal causal LMs (Gemma 3, Gemma 4): the composite serves its language model.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
from conftest import tiny

import attnlens


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


#: A type's family, a checkpoint of it built of another part, and which part (`LanguageModelOf.built_of`).
OTHER_PARTS = {
    "internvl": ({"text_config": {"model_type": "qwen3", "head_dim": 16}}, "text", "'qwen3'"),  # InternVL 3.5
    "mistral3": ({"text_config": {"model_type": "ministral3"}}, "text", "'ministral3'"),  # Ministral 3
    "lighton_ocr": ({"text_config": {"model_type": "mistral"}}, "text", "'mistral'"),
    "llava_onevision": ({"vision_config": {"model_type": "clip_vision_model"}}, "vision", "'clip_vision_model'"),
    "idefics3": ({"text_config": {"model_type": "mistral"}}, "text", "'mistral'"),
}


@pytest.mark.parametrize("model_type", sorted(OTHER_PARTS))
def test_a_checkpoint_built_of_other_parts_is_declined_by_its_types_family_and_refused_given_it(model_type):
    """Can fail: a checkpoint of the type whose language model (or tower) is another type's would be served with the
    family's arithmetic. Loaded as it is, the family declines it with the part named, and it is served as a type
    without a family (the common layout inferred, or its block inputs and outputs); given `family=`, it is refused."""
    import warnings

    from attnlens.registry import family_for

    family = family_for(model_type)
    overrides, part, named = OTHER_PARTS[model_type]
    recipe = family.tiny.kwargs
    config = {key: {**recipe[key], **value} for key, value in overrides.items()}
    raw = attnlens.models.tiny_model(model_type, **config)
    said = family.declines(raw.config)
    assert said is not None and f"its {part} model is {named}" in said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = attnlens.StandardizedTransformer(raw, tokenizer=attnlens.models.char_tokenizer())
    assert type(model.family) is not type(family) and any("declines" in str(w.message) for w in caught)
    with pytest.raises(attnlens.errors.Miswired, match=f"its {part} model is {named}"):
        attnlens.StandardizedTransformer(raw, tokenizer=attnlens.models.char_tokenizer(), family=family)
