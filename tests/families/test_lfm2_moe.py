"""Lfm2Moe (attnlens/families/lfm2_moe.py): what the shared identities cannot see."""

from conftest import tiny


def test_lfm2_moe_reasons_on_its_expert_layers():
    model = tiny("lfm2_moe")
    for key in ("mlp.mlp_activation", "mlp.mlp_neurons"):
        assert model.support(0)[key] is None
        assert "Lfm2MoeExperts" in model.support(1)[key]
