"""Mixtral (attnlens/families/mixtral.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens


def test_moe_out_of_order_read_raises():
    model = tiny("mixtral")
    with pytest.raises(attnlens.OrderError, match="mlp_input"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].mlp.mlp_output.save()
            model.layers[1].mlp_input.save()
