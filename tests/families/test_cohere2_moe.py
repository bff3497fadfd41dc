"""Cohere2Moe (attnlens/families/cohere2_moe.py): what the shared identities cannot see."""

from conftest import tiny


def test_cohere2_moe_rotates_only_sliding_and_prefix_layers():
    model = tiny("cohere2_moe")
    notes = [model.support(i).notes["self_attn.attention_queries"] for i in range(3)]
    assert notes[1].startswith("not rotated") and notes[0].startswith("rotated") and notes[2].startswith("rotated")
    assert model.support(1)["mlp.mlp_neurons"] is not None and model.support(0)["mlp.mlp_neurons"] is None
