"""The speech encoder-decoders attnlens records as refused, each with what its model does that attnlens does not
reproduce: Dia's codebook decoder, Cohere ASR's and Canary's FastConformer encoder."""

import warnings

import pytest
from transformers import AutoConfig

import attnlens
from attnlens.registry import encoder_decoders
from attnlens.stacks import refusal


@pytest.mark.parametrize(
    ("model_type", "said"),
    [
        ("dia", "[batch * num_channels, frames, vocab]"),
        ("cohere_asr", "Transformer-XL's relative-position attention"),
        ("canary", "two half-step feed-forwards"),
    ],
)
def test_a_refused_speech_type_says_what_attnlens_does_not_reproduce(model_type, said):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type)
    reason = refusal(config)
    assert reason.startswith(f"attnlens has no encoder-decoder family for model type {model_type!r}: ")
    assert said in reason
    assert model_type not in encoder_decoders()
    with pytest.raises(attnlens.UnknownFamily, match=r"not served yet|not attnlens.s attention-then-MLP"):
        attnlens.registry.encoder_decoder_for(model_type)
