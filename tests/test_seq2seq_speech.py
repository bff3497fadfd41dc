"""The speech and multilingual encoder-decoders' own arithmetic: Speech2Text's positions in time (its input's frames on
their second axis, four to a position), SeamlessM4T's speech-to-text class refused for its conformer encoder while its
text-to-text class is served, SpeechT5's relative position term (by hand, and an edit of it against transformers run
with a hook) and its positions in the waveform."""

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


def test_speecht5_relative_position_term_is_each_query_against_its_distance_embedding():
    """The encoder's `attention_position_bias`: each scaled query against `pe_k`'s row for its key's distance, clamped
    to +-encoder_max_relative_position (8 in the tiny model, shorter than its 19 positions); the scores add it."""
    model = tiny("speecht5")
    with torch.no_grad(), model.trace(**source("speecht5"), decoder_input_ids=TARGET):
        attention = model.encoder.layers[1].self_attn
        queries, keys = attention.attention_queries.save(), attention.attention_keys.save()
        bias, scores = attention.attention_position_bias.save(), attention.attention_scores.save()
    length, limit = queries.shape[2], model.config.encoder_max_relative_position
    assert length == 19 > limit
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    rows = distance.clamp(-limit, limit - 1) + limit
    table = model.encoder._module.wrapped_encoder.embed_positions.pe_k.weight
    by_hand = torch.einsum("bhqd,qkd->bhqk", queries, table[rows])
    torch.testing.assert_close(bias, by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores, queries @ keys.transpose(-1, -2) + bias, atol=1e-5, rtol=1e-5)
    far = distance.abs() >= limit  # distances past the table share its last rows
    assert bool(far.any()) and torch.equal(rows[0, limit:], torch.full((length - limit,), 0))


def test_speecht5_position_bias_edit_moves_the_logits_as_a_hook_on_transformers_predicts():
    """Doubling layer 1's relative term through attnlens equals transformers run with that layer's attention given
    twice the relative embeddings (the term is linear in them); the logits move."""
    model = tiny("speecht5")
    inputs = source("speecht5")
    with torch.no_grad(), model.trace(**inputs, decoder_input_ids=TARGET):
        plain = model.logits.save()
    with torch.no_grad(), model.trace(**inputs, decoder_input_ids=TARGET):
        attention = model.encoder.layers[1].self_attn
        attention.attention_position_bias = attention.attention_position_bias * 2
        edited = model.logits.save()
    module = model.encoder._module.wrapped_encoder.layers[1].attention

    def doubled(module, args, kwargs):
        return args, {**kwargs, "position_bias": kwargs["position_bias"] * 2}

    handle = module.register_forward_pre_hook(doubled, with_kwargs=True)
    try:
        with torch.no_grad():
            expected = model._module(**inputs, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()
    torch.testing.assert_close(edited, expected, atol=1e-5, rtol=1e-5)
    assert float((edited - plain).abs().max()) > 1e-3


def test_speecht5_positions_are_its_waveform_in_time():
    """`model.positions(input_values)`: the feature encoder's strides (5 then 2: ten samples, 0.625 ms at 16 kHz in
    the tiny model), as many as the encoder's positions (the positional convolution keeps the count). A changed
    sample moves the feature encoder's output at the position covering it and the one before (its reach: samples
    10p .. 10p + 19)."""
    model = tiny("speecht5")
    waveform = source("speecht5")["input_values"]
    positions = model.positions(waveform)
    with torch.no_grad(), model.trace(input_values=waveform, decoder_input_ids=TARGET):
        features = model.encoder.prenet.feature_encoder.output.save()
        first = model.encoder.layers[0].layer_input.save()
    assert len(positions.start) == features.shape[-1] == first.shape[1] == 19
    torch.testing.assert_close(positions.end - positions.start, torch.full((19,), 10 / 16000, dtype=torch.float64))
    for sample in (0, 57, 123, 185):
        moved = waveform.clone()
        moved[:, sample] += 1.0
        with torch.no_grad(), model.trace(input_values=moved, decoder_input_ids=TARGET):
            changed = model.encoder.prenet.feature_encoder.output.save()
        where = (changed - features).abs().amax(1)[0].nonzero().flatten().tolist()
        covering = positions.at((sample + 0.5) / 16000)
        assert covering == sample // 10 and covering in where and set(where) <= {covering - 1, covering}, where


@pytest.mark.parametrize("model_type", ["t5", "pop2piano"])
def test_positions_of_an_encoder_without_convolutions_over_time_are_refused_with_what_its_positions_are(model_type):
    """T5 reads tokens; Pop2Piano reads feature frames as input embeddings: neither has convolutions over time to
    place its positions in seconds, and the refusal says what a position is instead."""
    model = tiny(model_type)
    with pytest.raises(attnlens.Unavailable, match=r"no convolutions over time.*a token, or a frame handed over"):
        model.positions(torch.zeros(1, 8, 4))
