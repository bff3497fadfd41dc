"""The encoder-decoders built as T5 is (attnlens/families/t5_like.py), on their own arithmetic: Switch Transformers'
top-1 router recomputed by hand and a re-routed token's output moving the logits as a hook on plain transformers
predicts; Pop2Piano's encoder reading its features (a composer's embedding first, under generate)."""

import pytest
import torch
from test_seq2seq import SOURCE, TARGET, tiny

import attnlens


def routed(sparse, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """Each token of `x` [seq, hidden] through its `rank`-th best expert of `sparse` (a SwitchTransformersSparseMLP),
    times that expert's router probability: the sparse feed-forward by hand (rank 0, within the capacity)."""
    probabilities = (x @ sparse.router.classifier.weight.T).softmax(-1)
    chosen = probabilities.topk(rank + 1, dim=-1).indices[:, rank]
    return torch.stack(
        [probabilities[t, e] * sparse.experts[f"expert_{int(e)}"](x[t]) for t, e in enumerate(chosen)]
    ), chosen


def test_switch_routes_each_token_to_its_best_expert_as_recomputed_by_hand():
    model = tiny("switch_transformers")
    block = model.encoder.layers[1]
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        x = block.mlp_input.save()
        out = block.mlp.mlp_output.save()
    sparse = block._module.layer[1].mlp
    with torch.no_grad():
        expected, chosen = routed(sparse, x[0])
    assert torch.allclose(out[0], expected, atol=1e-6)
    assert len(set(chosen.tolist())) > 1, "the tokens go to several experts"
    # block 0 keeps T5's dense feed-forward; block 1 (every encoder_sparse_step-th from 1) is sparse
    assert model.encoder.support(0)["mlp.mlp_neurons"] is None
    assert "sparse mixture of experts" in model.encoder.support(1)["mlp.mlp_neurons"]
    assert "sparse mixture of experts" in model.decoder.support(1)["mlp.mlp_activation"]
    assert model.decoder.support(0)["mlp.mlp_activation"] is None


def test_a_token_sent_to_its_second_expert_moves_the_logits_as_a_hook_predicts():
    """mlp_output of the encoder's sparse block with token 2 re-routed to its second-best expert (by hand, from the
    served mlp_input) equals re-routing it inside transformers' SparseMLP by a hook on its output."""
    model = tiny("switch_transformers")
    block = model.encoder.layers[1]
    sparse = block._module.layer[1].mlp
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        x = block.mlp_input.save()
        out = block.mlp.mlp_output.save()
        plain = model.logits.save()
    with torch.no_grad():
        second, _ = routed(sparse, x[0], rank=1)
    rerouted = out.clone()
    rerouted[0, 2] = second[2]
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        block.mlp.mlp_output = rerouted
        moved = model.logits.save()

    def reroute(module, args, output):
        output = output.clone()
        output[0, 2] = routed(module, args[0][0], rank=1)[0][2]
        return output

    handle = sparse.register_forward_hook(reroute)
    try:
        with torch.no_grad():
            expected = model._module(input_ids=SOURCE, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()
    assert torch.allclose(moved, expected, atol=1e-5)
    assert not torch.allclose(moved, plain, atol=1e-4)


def test_pop2pianos_encoder_reads_the_composer_then_the_features_and_serves_no_embeddings():
    model = tiny("pop2piano")
    hf = model._module
    features = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), model.generate(input_features=features, max_new_tokens=1) as tracer:
        first = model.encoder.layers[0].layer_input.save()
        tracer.result.save()
    composer = hf.generation_config.composer_to_feature_token["composer1"]
    offset = min(hf.generation_config.composer_to_feature_token.values())
    assert first.shape == (1, 7, 64)
    assert torch.equal(first[0, 0], hf.mel_conditioner.embedding.weight[composer - offset])
    assert torch.equal(first[0, 1:], features[0])
    assert "input_features" in model.encoder.support(0)["embeddings"]
    with pytest.raises(attnlens.Unavailable, match="embed_tokens never runs"):
        with model.trace(input_features=features, decoder_input_ids=TARGET):
            model.encoder.embeddings.save()


# --- T5Gemma ----------------------------------------------------------------------------------------------------------


def rotated(x: torch.Tensor, theta: float) -> torch.Tensor:
    """`x` [batch, heads, seq, dim] rotated as rotary positions 0..seq-1 rotate it (halves paired)."""
    dim = x.shape[-1]
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    angles = torch.arange(x.shape[2], dtype=torch.float)[:, None] * inverse
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def test_t5gemmas_encoder_scores_are_rotated_soft_capped_and_windowed_both_ways_by_hand():
    """Encoder block 1 slides: its queries are q_proj of its norm's output rotated; its pattern is the softmax of
    tanh(q.k * query_pre_attn_scalar ** -0.5 / cap) * cap, keys more than sliding_window away either side masked.
    The cross-attention's queries are not rotated."""
    model = tiny("t5gemma")
    config = model.config.encoder
    block = model.encoder.layers[1]
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        normed = block.attention_norm_output.save()
        queries = block.self_attn.attention_queries.save()
        keys = block.self_attn.attention_keys.save()
        pattern = block.self_attn.attention_probabilities.save()
        cross_normed = model.decoder.layers[0].cross_attention_norm_output.save()
        cross_queries = model.decoder.layers[0].cross_attn.attention_queries.save()
    attention = block._module.self_attn
    with torch.no_grad():
        projected = attention.q_proj(normed).view(1, SOURCE.shape[1], 4, 16).transpose(1, 2)
        assert torch.allclose(queries, rotated(projected, config.rope_parameters["rope_theta"]), atol=1e-5)
        assert not torch.allclose(queries, projected, atol=1e-3)
        cap, window = config.attn_logit_softcapping, config.sliding_window
        scores = queries @ keys.repeat_interleave(2, dim=1).transpose(2, 3) * config.query_pre_attn_scalar**-0.5
        scores = torch.tanh(scores / cap) * cap
        distance = torch.arange(6)[:, None] - torch.arange(6)[None, :]
        scores = scores.masked_fill(distance.abs() > window, torch.finfo(scores.dtype).min)
        assert torch.allclose(pattern, scores.softmax(-1), atol=1e-6)
        assert (pattern[..., 0, window + 1 :] == 0).all() and (pattern[..., 0, : window + 1] > 0).all()
        projected = model.decoder.layers[0]._module.cross_attn.q_proj(cross_normed)
        assert torch.equal(cross_queries, projected.view(1, TARGET.shape[1], 4, 16).transpose(1, 2))
    assert (
        f"up to {window} positions before or after"
        in model.encoder.support(1).notes["self_attn.attention_probabilities"]
    )


def test_a_t5gemma_cross_head_ablated_moves_the_logits_as_a_hook_predicts():
    """Zeroing head 1 of decoder block 1's cross-attention (its post-norm then normalises what is left) equals zeroing
    its slice of o_proj's input by a hook on plain transformers."""
    model = tiny("t5gemma")
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        plain = model.logits.save()
    with torch.no_grad(), model.trace(input_ids=SOURCE, decoder_input_ids=TARGET):
        heads = model.decoder.layers[1].cross_attn.attention_head_outputs
        heads[:, :, 1] = 0
        logits = model.logits.save()

    def zero_head(module, args):
        merged = args[0].clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 1] = 0
        return (merged,)

    projection = model.decoder.layers[1]._module.cross_attn.o_proj
    handle = projection.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            expected = model._module(input_ids=SOURCE, decoder_input_ids=TARGET).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-4)
