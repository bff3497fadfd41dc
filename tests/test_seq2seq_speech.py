"""The speech and multilingual encoder-decoders' own arithmetic: Speech2Text's positions in time (its input's frames on
their second axis, four to a position), SeamlessM4T's speech-to-text class refused for its conformer encoder while its
text-to-text class is served."""

import warnings

import pytest
import torch
import transformers
from test_seq2seq import TARGET, source, tiny

import attnlens


def test_speech_to_text_positions_are_four_frames_each_on_the_frames_axis():
    """`model.positions(input_features)` on Speech2Text: [batch, frames, features], time on axis 1; a position per four
    10 ms frames (two convolutions of stride 2). A change to one frame moves the first block's input at the position
    covering it and at most two either side (two kernels of 5: frames 4p - 6 .. 4p + 6 reach position p)."""
    model = tiny("speech_to_text")
    features = source("speech_to_text")["input_features"]
    positions = model.positions(features)
    with torch.no_grad(), model.trace(input_features=features, decoder_input_ids=TARGET):
        plain = model.encoder.layers[0].layer_input.save()
    assert len(positions.start) == plain.shape[1] == 16
    torch.testing.assert_close(positions.end - positions.start, torch.full((16,), 0.04, dtype=torch.float64))
    for frame in (0, 21, 42, 63):
        moved = features.clone()
        moved[:, frame] += 1.0
        with torch.no_grad(), model.trace(input_features=moved, decoder_input_ids=TARGET):
            changed = model.encoder.layers[0].layer_input.save()
        where = (changed - plain).abs().amax(-1)[0].nonzero().flatten().tolist()
        covering = positions.at(frame * 0.01 + 0.005)
        assert covering == frame // 4 and covering in where, where
        assert max(abs(p - covering) for p in where) <= 2, where


@pytest.mark.parametrize(
    ("model_type", "speech", "text"),
    [
        ("seamless_m4t", "SeamlessM4TForSpeechToText", "SeamlessM4TForTextToText"),
        ("seamless_m4t_v2", "SeamlessM4Tv2ForSpeechToText", "SeamlessM4Tv2ForTextToText"),
    ],
)
def test_seamless_serves_its_text_to_text_model_and_refuses_the_speech_encoder(model_type, speech, text):
    """The tiny recipe builds the text-to-text class (the sequence-to-sequence LM registry's), not the speech
    registry's; a speech-to-text model on the same config is refused, its conformer encoder named."""
    assert type(tiny(model_type)._module).__name__ == text
    config = attnlens.models.tiny_seq2seq_model(model_type).config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, speech)(config).eval()
    with pytest.raises(TypeError, match=f"this {speech}: .*conformer") as refused:
        attnlens.StandardizedSeq2Seq(model, tokenizer=attnlens.models.char_tokenizer())
    assert text in str(refused.value)
