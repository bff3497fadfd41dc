"""LongcatFlash (attnlens/families/longcat_flash.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import N, trace


def test_longcat_serves_the_first_of_each_blocks_two_attentions():
    model = tiny("longcat_flash")
    block = model._module.model.layers[0]
    got = trace(
        model, lambda m: {"x": m.layers[0].attention_norm_output, "out": m.layers[0].self_attn.attention_output}
    )
    with torch.no_grad():
        rotary = type(model._module.model.rotary_emb)(model.config)
        mask = model.family.score_function().mask(N, N, model.config, 0)
        first = block.self_attn[0](got["x"], rotary(got["x"], torch.arange(N)[None]), mask)[0]
    assert torch.allclose(got["out"], first, atol=1e-5)
    assert "self_attn[1] is not served" in model.support(0).notes["self_attn.attention_queries"]
    assert "MoE shortcut" in model.support(0).notes["mlp.mlp_output"]
