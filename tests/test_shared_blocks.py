"""Zamba and Zamba2: the shared attention blocks of the hybrid layers, and what their Mamba layers serve.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for, shared

#: case -> (hybrid layers, Mamba layers)
CASES = {"zamba": ((2, 3), (0, 1, 4)), "zamba2": ((1, 3, 4), (0, 2)), "zamba2:plain": ((1, 3, 4), (0, 2))}


@pytest.mark.parametrize("case", CASES)
def test_attention_reads_the_norm_of_the_stream_and_the_embeddings(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][0]:
        joined = torch.cat([saved[(layer, "layer_input")], saved["embeddings"]], dim=-1)
        with torch.no_grad():
            normed = shared(model, layer).input_layernorm(joined)
        assert normed.shape[-1] == 2 * model.config.hidden_size
        assert close(normed, saved[(layer, "attention_norm_output")])
        assert "concat(layer_input, embeddings)" in model.support(layer).notes["attention_norm_output"]


@pytest.mark.parametrize("case", CASES)
def test_mlp_norm_reads_the_attention_output_with_no_residual(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][0]:
        with torch.no_grad():
            normed = shared(model, layer).pre_ff_layernorm(saved[(layer, "attention_output")])
        assert close(normed, saved[(layer, "mlp_norm_output")])
        reason = model.support(layer)["layer_mid"]
        assert "no residual add" in reason and "shared attention block" in reason


@pytest.mark.parametrize("case", CASES)
def test_layer_output_is_the_mamba_layer_over_the_projected_mlp_output(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][0]:
        block = model.layers[layer]._module
        with torch.no_grad():
            projected = block.linear(saved[(layer, "mlp_output")])
            stream = saved[(layer, "layer_input")]
            inner = block.mamba_decoder
            expected = stream + inner.mamba(inner.input_layernorm(stream + projected))
        assert close(expected, saved[(layer, "layer_output")])


@pytest.mark.parametrize("case", CASES)
def test_mamba_layers_serve_the_mixer_output_and_no_mlp(case):
    model, saved = tiny(case), saved_for(case)
    for layer in CASES[case][1]:
        block = model.layers[layer]._module
        with torch.no_grad():
            mixed = block.mamba(block.input_layernorm(saved[(layer, "layer_input")]))
        assert close(mixed, saved[(layer, "attention_output")])
        assert close(saved[(layer, "layer_mid")], saved[(layer, "layer_output")])
        report = model.support(layer)
        assert "Mamba" in report["self_attn.attention_queries"]
        assert "has no MLP" in report["mlp.mlp_output"]
        assert report["self_attn.attention_output"] is None and report.notes["self_attn.attention_output"]


@pytest.mark.parametrize("case", CASES)
def test_tied_blocks_are_addressed_per_layer(case):
    model, saved = tiny(case), saved_for(case)
    first, second = CASES[case][0][:2]
    a, b = shared(model, first), shared(model, second)
    assert a is not b
    assert not close(saved[(first, "attention_queries")], saved[(second, "attention_queries")], atol=1e-3)
    # Editing one layer's shared attention leaves the earlier tied layer's values as they were, and moves the later.
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[second].self_attn.attention_head_outputs = 0
        logits = model.logits.save()
    assert not close(logits, saved["logits"], atol=1e-4)
    with torch.no_grad(), model.trace(PROMPT):
        queries = model.layers[first].self_attn.attention_queries.save()
        model.layers[second].self_attn.attention_head_outputs = 0
        premix = model.layers[second].self_attn.attention_premix.save()
    assert close(queries, saved[(first, "attention_queries")])
    assert bool((premix == 0).all())
