"""Families whose vLLM module names were never checked are refused before an engine starts, not guessed."""

import pytest
from transformers import LlamaConfig

import attnlens


def test_an_unchecked_family_is_refused_naming_what_to_do(tmp_path):
    # A family of the user's own for Llama checkpoints, whose vLLM locations nobody checked (every built-in family is
    # served on vLLM or refused there with vLLM's reason).
    class Mine(attnlens.Family):
        model_types = ("llama",)

    LlamaConfig().save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="model_types") as error:
        attnlens.StandardizedVLLM(str(tmp_path), family=Mine)
    assert "Mine family's vLLM locations are not checked for model type 'llama'" in str(error.value)
