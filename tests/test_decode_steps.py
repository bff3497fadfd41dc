"""Decode steps against the whole cache on layouts whose attention is shared or post-norm (Zamba, Zamba2, GIT).

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close


def heads(x, module):
    return x.view(*x.shape[:2], -1, module.head_dim).transpose(1, 2)


NAMES = (
    "attention_queries",
    "attention_keys",
    "attention_values",
    "attention_scores",
    "attention_probabilities",
    "attention_head_outputs",
)


@pytest.mark.parametrize(("case", "layer"), [("zamba", 3), ("zamba2", 4), ("git", 2)])
def test_each_decode_step_sees_the_whole_cache(case, layer):
    model = tiny(case)
    attn = model.layers[layer].self_attn
    n = len(model.tokenizer(PROMPT).input_ids)
    ranks = model.order(layer)
    order = sorted(NAMES, key=lambda name: ranks[f"self_attn.{name}"])
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            read = {name: getattr(attn, name) for name in order}  # in forward order: GIT's values follow its pattern
            steps.append(tuple(read[name] for name in NAMES))
    groups = attn.num_heads // attn.num_kv_heads
    for step, (q, k, v, scores, probs, heads) in enumerate(steps):
        rows, keys = (n, n) if step == 0 else (1, n + step)
        assert q.shape[2] == rows and k.shape[2] == keys == v.shape[2] and probs.shape[2:] == (rows, keys)
        assert close(model.family.score_function().scores(attn.heads, model.config, q, k, layer), scores)
        assert close((probs @ v.repeat_interleave(groups, dim=1)).transpose(1, 2), heads)
    assert close(steps[1][1][:, :, :-1], steps[0][1])
