"""The lightning indexer of DeepSeek-V3.2 and GLM-MoE-DSA: the keys it does not choose are masked.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import N, trace

import attnlens
from attnlens.models import char_tokenizer, tiny_model


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa"])
def test_the_indexer_masks_the_keys_it_does_not_choose(case):
    """With index_topk below the prompt's length the pattern is the softmax over the chosen keys only: exactly zero
    elsewhere, and the family's (causal) score function equal on the chosen keys. sdpa's rebuild applies the model's
    own mask, so it is zero outside that run's own choice. On GLM-MoE-DSA's "shared" layer 1 the choice is layer 0's."""
    model = tiny(case, index_topk=4)
    sees = indexer_choice(model)
    assert not sees.all()  # the choice binds

    def read(m):
        return {
            (i, name): getattr(m.layers[i].self_attn, name)
            for i in (0, 1)
            for name in ("attention_queries", "attention_keys", "attention_scores", "attention_probabilities")
        }

    got = trace(model, read)
    for layer in (0, 1) if case == "glm_moe_dsa" else (0,):
        probs, scores = got[layer, "attention_probabilities"], got[layer, "attention_scores"]
        assert ((probs[0] > 0) == sees).all()
        assert torch.allclose(scores.softmax(-1), probs, atol=1e-6)
        rebuilt = model.family.score_function().scores(
            model.layers[layer].self_attn.heads,
            model.config,
            got[layer, "attention_queries"],
            got[layer, "attention_keys"],
            layer,
        )
        assert torch.allclose(rebuilt[..., sees], scores[..., sees], atol=1e-5)
    assert "index_topk=4" in model.support(0).notes["self_attn.attention_probabilities"]
    sdpa = attnlens.StandardizedTransformer(
        tiny_model(case, index_topk=4, attn_implementation="sdpa"), tokenizer=char_tokenizer(), rebuild_patterns=True
    )
    rebuilt = trace(sdpa, lambda m: {"p": m.layers[0].self_attn.attention_probabilities})["p"]
    # sdpa's run chooses for itself: ties in the indexer's scores may break otherwise than under eager
    assert ((rebuilt[0] > 0) == indexer_choice(sdpa)).all()
    assert torch.allclose(rebuilt.sum(-1), torch.ones(1, 4, N), atol=1e-5)


def indexer_choice(model):
    """Which keys layer 0's indexer lets each query see (chosen, and causal)."""
    with torch.no_grad(), model.trace(PROMPT):
        chosen = model.layers[0].self_attn.indexer.output.save()
    picked = torch.zeros(N, N, dtype=torch.bool).scatter(-1, chosen[0].long(), True)
    return picked & torch.ones(N, N, dtype=torch.bool).tril()
