"""GraniteMoeHybrid (attnlens/families/granitemoehybrid.py): what the shared identities cannot see."""

from conftest import tiny


def test_granite_hybrid_cannot_name_its_mamba_layers_self_attn():
    model = tiny("granitemoehybrid")
    reason = model.support(0)["self_attn.attention_output"]
    assert "keeps self_attn = None" in reason and "model.layers[0].mamba.output" in reason
    assert model.support(0)["mlp.mlp_output"].startswith("the MLP is the routed experts")
    assert model.support(1)["self_attn.attention_output"] is None
