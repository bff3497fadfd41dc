"""Dots3Note (attnlens/families/dots3_note.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import N, trace


def test_head_scalar_gates_take_only_constant_assignments():
    needs("dots3_note_text")
    model = tiny("dots3_note_text")
    got = trace(model, lambda m: {"g": m.layers[0].self_attn.attention_gate})
    assert got["g"].shape == (1, N, 4, 16) and torch.equal(got["g"], got["g"][..., :1].expand_as(got["g"]))
    with pytest.raises(Exception, match="constant along the head's channels"):
        with torch.no_grad(), model.trace(PROMPT):
            gate = model.layers[0].self_attn.attention_gate
            model.layers[0].self_attn.attention_gate = torch.rand_like(gate)
