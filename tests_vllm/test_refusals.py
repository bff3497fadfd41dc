"""Families whose vLLM module names were never checked are refused before an engine starts, not guessed."""

import pytest
from transformers import BioGptConfig

import attnlens


def test_an_unchecked_family_is_refused_naming_what_to_do(tmp_path):
    BioGptConfig(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=2, intermediate_size=64, vocab_size=128
    ).save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="model_types") as error:
        attnlens.StandardizedVLLM(str(tmp_path))
    assert "'biogpt'" in str(error.value)
