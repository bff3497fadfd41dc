"""MiniMax (attnlens/families/minimax.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import close, saved_for


def test_minimax_adds_attention_to_the_normalised_stream():
    model, saved = tiny("minimax"), saved_for("minimax")
    for layer in (0, 1):  # a softmax layer and a lightning layer
        block = model.layers[layer]._module
        with torch.no_grad():
            mid = (
                block.input_layernorm(saved[(layer, "layer_input")]) * block.attn_alpha_factor
                + saved[(layer, "attention_output")] * block.attn_beta_factor
            )
        assert close(mid, saved[(layer, "layer_mid")])
        assert not close(saved[(layer, "layer_input")] + saved[(layer, "attention_output")], mid, atol=1e-2)
    assert "a lightning-attention layer" in model.support(1)["self_attn.attention_scores"]
