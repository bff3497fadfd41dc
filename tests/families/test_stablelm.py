"""StableLm (attnlens/families/stablelm.py): what the shared identities cannot see."""

from conftest import tiny
from identities import LAYER


def test_order_with_and_without_the_parallel_residual():
    head = [
        "layer_input",
        "attention_norm_output",
        "self_attn.attention_cache_keys",
        "self_attn.attention_cache_values",
        "self_attn.attention_cache_visible",
        "self_attn.attention_queries",
        "self_attn.attention_keys",
        "self_attn.attention_key_positions",
        "self_attn.attention_values",
        "self_attn.attention_scores",
        "self_attn.attention_probabilities",
        "self_attn.attention_head_outputs",
        "self_attn.attention_premix",
        "self_attn.attention_output",
    ]
    tail = ["mlp_input", "mlp.mlp_activation", "mlp.mlp_neurons", "mlp.mlp_output", "layer_output"]
    assert list(tiny("stablelm").order(LAYER)) == [*head, "layer_mid", "mlp_norm_output", *tail]
    parallel = tiny("stablelm:parallel").order(LAYER)
    assert list(parallel) == [*head, "mlp_norm_output", *tail]
    assert parallel["mlp_norm_output"] == parallel["mlp_input"]
    assert "layer_mid" not in parallel
