"""Families whose vLLM module names were never checked are refused before an engine starts, not guessed."""

import pytest
from transformers import CodeGenConfig

import attnlens


def test_an_unchecked_family_is_refused_naming_what_to_do(tmp_path):
    # CodeGen: registered, its vLLM locations never checked (BioGpt, once the example, is served now)
    CodeGenConfig(n_layer=1, n_embd=64, n_head=2, vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="model_types") as error:
        attnlens.StandardizedVLLM(str(tmp_path))
    assert "'codegen'" in str(error.value)
