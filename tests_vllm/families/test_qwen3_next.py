"""Qwen3-Next on vLLM (bfloat16): the gated full-attention layers' head outputs and gate, the Gated DeltaNet layers'
premix and output, what `support()` says of them, and edits, against the transformers engine."""

import pytest
import torch
from conftest import pair
from test_equal_to_eager import HALF_TOLERANCE, close

import attnlens

FULL, LINEAR = 0, 1  # the tiny checkpoint's layer kinds (Family.vllm.tiny)


def next_logits(model, prompt, edit=None):
    with torch.no_grad(), model.trace(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0):
        if edit is not None:
            edit(model)
        logits = model.logits[:, -1].float().clone().save()
    return logits


def test_support_on_vllm_serves_the_gate_and_the_linear_layers_output(tmp_path_factory):
    model = pair("qwen3_next", tmp_path_factory).vllm
    full, linear = model.support(FULL), model.support(LINEAR)
    for value in ("attention_head_outputs", "attention_gate", "attention_premix", "attention_probabilities"):
        assert full[f"self_attn.{value}"] is None, value
    assert "before the output gate" in full.notes["self_attn.attention_head_outputs"]
    assert "qkv_proj" in full.notes["self_attn.attention_gate"]
    assert "read-only" in full.notes["self_attn.attention_probabilities"]
    assert linear["self_attn.attention_premix"] is None and linear["self_attn.attention_output"] is None
    assert "Gated DeltaNet" in linear["self_attn.attention_probabilities"]
    assert "silu(z)" in linear["self_attn.attention_gate"]
    assert "mixture-of-experts" in linear["mlp.mlp_neurons"] and linear["mlp.mlp_output"] is None


def ablate_head(model):
    model.layers[FULL].self_attn.attention_head_outputs[:, :, 1] = 0


def close_gate(model):
    model.layers[FULL].self_attn.attention_gate[:, :, 1] = 0


def scaled_linear_premix(model):
    model.layers[LINEAR].self_attn.attention_premix = model.layers[LINEAR].self_attn.attention_premix * 0.5


EDITS = [ablate_head, close_gate, scaled_linear_premix]


@pytest.mark.parametrize("edit", EDITS, ids=[edit.__name__ for edit in EDITS])
def test_an_edit_moves_the_logits_as_on_eager(edit, tmp_path_factory):
    models = pair("qwen3_next", tmp_path_factory)
    clean = next_logits(models.vllm, models.prompt)
    edited = next_logits(models.vllm, models.prompt, edit)
    assert not close(edited, clean, HALF_TOLERANCE)
    assert close(edited, next_logits(models.eager, models.prompt, edit), HALF_TOLERANCE)


def test_closing_a_heads_gate_is_ablating_it(tmp_path_factory):
    models = pair("qwen3_next", tmp_path_factory)
    assert torch.equal(
        next_logits(models.vllm, models.prompt, close_gate), next_logits(models.vllm, models.prompt, ablate_head)
    )


def test_the_pattern_of_a_gated_layer_is_read_only_on_vllm(tmp_path_factory):
    model = pair("qwen3_next", tmp_path_factory).vllm

    def uniform(model):
        attn = model.layers[FULL].self_attn
        attn.attention_scores = attnlens.keep_masked(attn.attention_scores, 0.0)

    with pytest.raises(attnlens.EditError, match="past the output gate"):
        next_logits(model, "Hello", uniform)


def test_static_taps_are_refused_on_a_layer_without_an_attention_kernel(tmp_path_factory):
    from attnlens.vllm import static

    model = pair("qwen3_next", tmp_path_factory).vllm
    assert static.declare(model, [f"premix.{FULL}"]) == [f"premix.{FULL}"]
    with pytest.raises(attnlens.Unavailable, match=f"layer {LINEAR} has no attention kernel on vLLM"):
        static.declare(model, [f"premix.{LINEAR}"])
