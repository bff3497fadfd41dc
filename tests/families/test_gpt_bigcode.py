"""GPTBigCode (attnlens/families/gpt_bigcode.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import LAYER, at, attention_module, close, heads, visible

import attnlens


@pytest.mark.parametrize("case", ["gpt_bigcode", "gpt_bigcode:multi_head"])
def test_gpt_bigcode_split(case):
    model = tiny(case)
    module = attention_module(case)
    h, d = module.num_heads, module.head_dim
    with torch.no_grad():
        fused = module.c_attn(at(case, "attention_norm_output"))
    if model.config.multi_query:  # [q (all heads) | k (one head) | v (one head)]
        q, k, v = heads(fused[..., : h * d], d), fused[..., None, h * d : h * d + d], fused[..., None, h * d + d :]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        assert model.layers[LAYER].self_attn.num_kv_heads == 1
    else:  # per head [q|k|v]
        q, k, v = fused.view(*fused.shape[:2], h, 3 * d).transpose(1, 2).split(d, dim=-1)
    assert torch.equal(at(case, "attention_queries"), q)
    assert torch.equal(at(case, "attention_keys"), k) and torch.equal(at(case, "attention_values"), v)


def test_gpt_bigcode_multi_query_keys_edit_in_place_for_every_head():
    model = tiny("gpt_bigcode")
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_keys[:] = 0  # the one shared key head
        probs = attn.attention_probabilities.save()
    n = probs.shape[-1]
    uniform = visible(model.config, model.family, LAYER, n) / torch.arange(1, n + 1)[:, None]
    assert close(probs[0], uniform.expand_as(probs[0]))
    with pytest.raises(attnlens.EditError, match="Assign it instead"):
        with model.trace(PROMPT):
            attn.attention_queries[:] = 0
