"""Bloom on vLLM: where vLLM's Bloom differs from transformers' (its exact GELU)."""

import torch
from conftest import PROMPT, pair


def test_bloom_mlp_is_vllms_exact_gelu(tmp_path_factory):
    """Where vLLM's Bloom differs from transformers': its MLP's GELU is exact (erf), not Bloom's tanh approximation.
    On vLLM's tensors the activation is the exact GELU of the up projection (the eager model's weights)."""
    models = pair("bloom", tmp_path_factory)
    model = models.vllm
    assert "exact GELU" in model.support(0).notes["mlp.mlp_activation"]
    with torch.no_grad(), model.trace(PROMPT):
        up = model.layers[0].mlp_input.clone().save()
        activation = model.layers[0].mlp.mlp_activation.clone().save()
    with torch.no_grad():
        pre = models.eager._module.transformer.h[0].mlp.dense_h_to_4h(up)
        tanh = models.eager._module.transformer.h[0].mlp.gelu_impl(pre)
    assert torch.allclose(activation, torch.nn.functional.gelu(pre), atol=1e-5)
    assert (activation - tanh).abs().max() > 1e-5
