"""GptOss (attnlens/families/gpt_oss.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import trace


def test_score_function_serves_decode_queries_against_a_sliding_window():
    # Fewer queries than keys, as at a decode step: the family's mask must place them at the end.
    model = tiny("gpt_oss")
    got = trace(
        model,
        lambda m: {
            "q": m.layers[0].self_attn.attention_queries,
            "k": m.layers[0].self_attn.attention_keys,
            "s": m.layers[0].self_attn.attention_scores,
        },
    )
    module = model.layers[0].self_attn._module
    last = model.family.score_function().scores(
        model.family.sizes.geometry(module, model.family), model.config, got["q"][:, :, -3:], got["k"], 0
    )
    assert torch.equal(last == torch.finfo(last.dtype).min, got["s"][:, :, -3:] == torch.finfo(last.dtype).min)
    assert torch.allclose(last, got["s"][:, :, -3:], atol=1e-5)
    assert (
        model.family.score_function().sliding_window(model.config, 0) == 4
        and model.family.score_function().sliding_window(model.config, 1) is None
    )


def test_gpt_oss_mlp_output_is_the_first_item_of_the_moe_output():
    model = tiny("gpt_oss")
    assert "loop over experts" in model.support(0)["mlp.mlp_activation"]
    got = trace(model, lambda m: {"x": m.layers[0].mlp_input, "out": m.layers[0].mlp.mlp_output})
    with torch.no_grad():
        out, router_scores = model.layers[0].mlp._module(got["x"])
    assert torch.equal(got["out"], out) and router_scores.shape[-1] == model.config.num_experts_per_tok
