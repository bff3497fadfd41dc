"""MiniMaxM3Text (attnlens/families/minimax_m3_vl.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, needs, tiny
from identities import N, trace


def test_minimax_m3_indexer_masks_the_blocks_it_does_not_choose():
    needs("minimax_m3_vl_text")
    model = tiny("minimax_m3_vl_text", index_topk_blocks=2)
    config = model.config
    with torch.no_grad(), model.trace(PROMPT):  # its own trace: the values are read inside the attention's .source
        chosen = model.layers[1].self_attn.indexer.output.save()
    got = trace(
        model,
        lambda m: {
            name: getattr(m.layers[1].self_attn, name)
            for name in ("attention_queries", "attention_keys", "attention_scores", "attention_probabilities")
        },
    )
    block = torch.arange(N) // config.index_block_size
    picked = (block[None, None, None, :, None] == chosen[..., None, :]).any(-1)  # [1, kv groups, q, k]
    sees = (picked & torch.ones(N, N, dtype=torch.bool).tril()).repeat_interleave(2, dim=1)
    assert not sees[..., torch.ones(N, N, dtype=torch.bool).tril()].all()  # the choice binds
    probs, scores = got["attention_probabilities"], got["attention_scores"]
    assert torch.equal(probs > 0, sees)
    rebuilt = model.family.score_function().scores(
        model.layers[1].self_attn.heads, config, got["attention_queries"], got["attention_keys"], 1
    )
    assert torch.allclose(rebuilt[sees], scores[sees], atol=1e-5)
    notes = model.support(1).notes
    assert "index_topk_blocks=2" in notes["self_attn.attention_probabilities"]
    assert "self_attn.attention_scores" not in model.support(0).notes  # a full-attention layer
    assert "inline" in model.support(0)["mlp.mlp_activation"] and model.support(0)["mlp.mlp_neurons"] is None
