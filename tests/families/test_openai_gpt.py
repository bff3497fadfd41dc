"""OpenAIGPT (attnlens/families/openai_gpt.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, tiny
from identities import close, saved_for


def test_openai_gpt_masks_future_keys_with_minus_ten_thousand():
    scores = saved_for("openai-gpt")[(0, "attention_scores")]
    future = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).triu(1)
    assert (scores[..., future] == -1e4).all()
    assert "replaced by -10000" in tiny("openai-gpt").support(0).notes["self_attn.attention_scores"]


def test_openai_gpt_is_post_norm():
    model, saved = tiny("openai-gpt"), saved_for("openai-gpt")
    block = model.layers[1]._module
    mid, out = saved[(1, "layer_mid")], saved[(1, "layer_output")]
    with torch.no_grad():
        assert close(block.ln_1(mid), saved[(1, "mlp_input")])
        assert close(block.ln_2(block.ln_1(mid) + saved[(1, "mlp_output")]), out)
    report = model.support(1)
    assert report["attention_norm_output"].startswith("a post-norm block: attention reads the block input")
    assert model.support()["final_norm_output"].startswith("no final norm")


def test_openai_gpt_keys_are_a_view_of_the_split():
    model = tiny("openai-gpt")
    with torch.no_grad():
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_keys[:, 1] = 0  # head 1's keys, in place through the transposed view
            scores = model.layers[0].self_attn.attention_scores.save()
    visible = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    assert (scores[:, 1][..., visible] == 0).all() and not (scores[:, 0][..., visible] == 0).all()
