"""Phi (attnlens/families/phi.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import LAYER

import attnlens


def test_reading_the_mlp_norm_output_before_attention_output_raises():
    model = tiny("phi")
    layer = model.layers[LAYER]
    with pytest.raises(attnlens.OrderError, match="attention_output"):
        with torch.no_grad(), model.trace(PROMPT):
            layer.mlp_norm_output.save()
            layer.self_attn.attention_output.save()
