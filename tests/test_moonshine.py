"""Moonshine and Moonshine Streaming's own arithmetic, recomputed by hand: the interleaved partial rotary embedding of
the queries and keys, an edit of the rotated queries against a hook on plain transformers, the padded heads of the
released checkpoints, the streaming encoder's per-layer windows, its norms' gain, and the positions of the waveform."""

import warnings

import pytest
import torch
from test_seq2seq import TARGET, source, tiny

import attnlens
from attnlens.checks import failures, read_stacks


def rotated_by_hand(x: torch.Tensor, rotary: int, theta: float = 10000.0) -> torch.Tensor:
    """`x` [batch, heads, position, head_dim] with each pair of neighbouring dimensions (0 and 1, 2 and 3, ...) among
    the first `rotary` turned by position * theta ** (-2 i / rotary), the rest as they are."""
    positions = torch.arange(x.shape[2], dtype=torch.float32)[:, None]
    angles = positions * theta ** (-torch.arange(0, rotary, 2, dtype=torch.float32) / rotary)  # [position, pairs]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., :rotary:2], x[..., 1:rotary:2]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([turned, x[..., rotary:]], dim=-1)


@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_the_queries_and_keys_are_rotated_in_neighbouring_pairs_on_half_of_each_head(stack):
    model = tiny("moonshine")
    block = getattr(model, stack).layers[1]
    with torch.no_grad(), model.trace(**source("moonshine"), decoder_input_ids=TARGET):
        attention_input = block.attention_norm_output.save()
        queries, keys = block.self_attn.attention_queries.save(), block.self_attn.attention_keys.save()
    attention = block.self_attn._module
    for read, projection in ((queries, attention.q_proj), (keys, attention.k_proj)):
        plain = projection(attention_input).detach()
        plain = plain.view(*plain.shape[:2], 4, 16).transpose(1, 2)
        torch.testing.assert_close(read, rotated_by_hand(plain, rotary=8), atol=1e-5, rtol=1e-5)
        assert torch.equal(read[..., 8:], plain[..., 8:])  # the half the rotation passes over
        assert not torch.allclose(read[..., 2:, :8], plain[..., 2:, :8], atol=1e-3)  # turned past position 0
    support = getattr(model, stack).support(1)
    assert "on the first 0.5 of each head's dimensions, interleaved" in support.notes["self_attn.attention_queries"]


def test_a_rotated_query_edit_moves_the_logits_as_a_hook_on_q_proj_predicts():
    """The rotation is linear: doubling head 2's rotated queries in decoder block 0 is doubling its slice of q_proj's
    output, which a hook on plain transformers does; the cross-attention's queries are not rotated and double
    likewise."""
    model = tiny("moonshine")
    inputs = {**source("moonshine"), "decoder_input_ids": TARGET}
    with torch.no_grad(), model.trace(**inputs):
        model.decoder.layers[0].self_attn.attention_queries[:, 2] *= 2
        model.decoder.layers[0].cross_attn.attention_queries[:, 1] *= 2
        logits = model.logits.save()

    def doubled(head):
        def hook(module, args, output):
            output = output.clone()
            output[..., head * 16 : (head + 1) * 16] *= 2
            return output

        return hook

    block = model._module.model.decoder.layers[0]
    handles = [
        block.self_attn.q_proj.register_forward_hook(doubled(2)),
        block.encoder_attn.q_proj.register_forward_hook(doubled(1)),
    ]
    try:
        with torch.no_grad():
            expected = model._module(**inputs).logits
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        plain = model._module(**inputs).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-3)


def test_padded_heads_serve_the_scores_and_premix_and_refuse_the_heads_with_the_reason():
    """A checkpoint that pads each head (config.pad_head_dim_to_multiple_of; here 16 to 24): the scores, the
    pattern and the premix equal transformers', the identities hold, and the per-head values are refused saying
    why."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = attnlens.models.tiny_seq2seq("moonshine", pad_head_dim_to_multiple_of=24)
    inputs = {**source("moonshine"), "decoder_input_ids": TARGET}
    saved = read_stacks(model, **inputs)
    for name in model.stacks:
        assert [failures(getattr(model, name), saved[name], layer) for layer in (0, 1)] == [[], []], name
    with torch.no_grad():
        reference = model._module(**inputs, output_attentions=True)
    for layer in (0, 1):
        assert torch.equal(saved["encoder"][(layer, "attention_probabilities")], reference.encoder_attentions[layer])
        assert torch.equal(
            saved["decoder"][(layer, "cross_attention_probabilities")], reference.cross_attentions[layer]
        )
    assert torch.equal(saved["decoder"]["logits"], reference.logits)
    assert saved["decoder"][(0, "attention_premix")].shape[-1] == 64
    support = model.decoder.support(0)
    for value in ("attention_queries", "attention_head_outputs"):
        for sublayer in ("self_attn", "cross_attn"):
            assert "pads each head with zeros" in support[f"{sublayer}.{value}"]
    assert support["self_attn.attention_scores"] is None
    with pytest.raises(attnlens.Unavailable, match="pads each head"):
        with model.trace(**inputs):
            model.encoder.layers[0].self_attn.attention_keys.save()


def test_the_streaming_encoder_attends_within_each_layers_window_where_a_mask_is_given():
    """With an attention mask, transformers masks each encoder layer to its (left, right) window; the score function
    recomputes the pattern from the queries and keys; without a mask every position is seen."""
    model = tiny("moonshine_streaming")
    audio = source("moonshine_streaming")["input_values"]
    mask = torch.ones_like(audio, dtype=torch.long)
    patterns = {}
    for masked in (True, False):
        extra = {"attention_mask": mask} if masked else {}
        read = []  # (a name bound inside a trace body does not outlive it; a list from outside does)
        with torch.no_grad(), model.trace(input_values=audio, **extra, decoder_input_ids=TARGET):
            for layer in (0, 1):
                attention = model.encoder.layers[layer].self_attn
                read.append(
                    (
                        attention.attention_queries.save(),
                        attention.attention_keys.save(),
                        attention.attention_probabilities.save(),
                    )
                )
        with torch.no_grad():
            reference = model._module(input_values=audio, **extra, decoder_input_ids=TARGET, output_attentions=True)
        patterns[masked] = [pattern for _, _, pattern in read]
        score_function = model.encoder.family.score_function()
        for layer, (queries, keys, pattern) in enumerate(read):
            assert torch.equal(pattern, reference.encoder_attentions[layer])
            heads = model.encoder.layers[layer].self_attn.heads
            key_mask = torch.ones(1, keys.shape[2], dtype=torch.long) if masked else None
            scores = score_function.scores(heads, model.config, queries, keys, layer, key_mask)
            torch.testing.assert_close(score_function.softmax(scores)[0], pattern, atol=1e-6, rtol=1e-5)
    positions = patterns[True][0].shape[-1]
    for layer, (left, right) in enumerate(model.config.encoder_config.sliding_windows):
        distance = torch.arange(positions)[:, None] - torch.arange(positions)[None, :]
        inside = ((distance >= 0) & (distance < left)) | ((distance < 0) & (-distance < right))
        assert bool((~inside).any()) and bool((patterns[True][layer][..., ~inside] == 0).all())
        assert bool((patterns[True][layer][..., inside] > 0).all())
        assert bool((patterns[False][layer] > 0).all())  # no mask: no window


def test_the_streaming_norms_gain_is_gamma_plus_one():
    model = tiny("moonshine_streaming")
    norm = model.encoder.layers[0]._module.input_layernorm
    gain = model.encoder.family.identities.norm_gain(norm)
    x = torch.randn(3, 64)
    normalised = torch.nn.functional.layer_norm(x, (64,))
    torch.testing.assert_close(norm(x), normalised * gain)
    assert not torch.allclose(gain, norm.gamma)


def test_moonshines_positions_are_its_waveform_in_time_and_streamings_are_refused():
    """One encoder position per 384 samples (24 ms at 16 kHz), as many as transformers' own length formula and the
    encoder give, for waveforms of several lengths; the streaming encoder's causal convolutions are refused."""
    model = tiny("moonshine")
    for samples in (3000, 4000, 16000):
        audio = torch.randn(1, samples)
        positions = model.positions(audio)
        with torch.no_grad():
            length = model._module.model.encoder(audio).last_hidden_state.shape[1]
        assert len(positions.start) == length == model._module._get_feat_extract_output_lengths(samples)
        torch.testing.assert_close(positions.start, torch.arange(length, dtype=torch.float64) * 384 / 16000)
        torch.testing.assert_close(positions.end - positions.start, torch.full((length,), 0.024, dtype=torch.float64))
    assert model.positions(torch.randn(1, 3000)).at(0.05) == 2
    with pytest.raises(attnlens.Unavailable, match="MoonshineStreamingCausalConv1d"):
        tiny("moonshine_streaming").positions(source("moonshine_streaming")["input_values"])
