"""Families whose vLLM module names were never checked are refused before an engine starts, not guessed."""

import pytest
from transformers import Llama4Config

import attnlens


def test_an_unchecked_family_is_refused_naming_what_to_do(tmp_path):
    # Llama 4's multimodal type: registered, its vLLM locations checked for the text model alone (llama4_text); CodeGen,
    # once the example, is refused with vLLM's reason now
    Llama4Config().save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="model_types") as error:
        attnlens.StandardizedVLLM(str(tmp_path))
    assert "'llama4'" in str(error.value)
