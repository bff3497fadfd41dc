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


@pytest.mark.parametrize(
    ("model_type", "said"),
    [
        ("whisper", "vLLM runs WhisperForConditionalGeneration (an encoder-decoder"),
        ("bart", "vLLM runs BartForConditionalGeneration only through an out-of-tree plugin"),
        ("t5", "vLLM has no implementation of T5ForConditionalGeneration"),
    ],
)
def test_an_encoder_decoder_is_refused_with_what_vllm_says_of_it(model_type, said, tmp_path):
    """Before an engine starts: vLLM's registry read for the checkpoint's class, and the engine that serves it."""
    attnlens.models.tiny_seq2seq_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily) as error:
        attnlens.StandardizedVLLM(str(tmp_path))
    assert said in str(error.value) and "attnlens.StandardizedSeq2Seq" in str(error.value)
