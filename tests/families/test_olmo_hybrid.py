"""OlmoHybrid (attnlens/families/olmo_hybrid.py): what the shared identities cannot see."""

from conftest import tiny


def test_olmo_hybrid_blocks_normalise_on_opposite_sides():
    model = tiny("olmo_hybrid")
    attention, linear = model.support(1), model.support(0)
    assert attention["attention_norm_output"].startswith("no norm in front of attention")
    assert linear["attention_norm_output"] is None and linear["mlp_norm_output"] is None
    assert "Gated DeltaNet" in linear["self_attn.attention_scores"]
    assert "post_attention_layernorm(attention_output)" in attention.notes["layer_mid"]
