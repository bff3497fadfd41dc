"""OPT on vLLM: the kernel scales the queries itself."""

import pytest
import test_equal_to_eager as equal
import torch
from conftest import PROMPT, pair

import attnlens


def test_opt_queries_and_scale_give_eagers_scores(tmp_path_factory):
    """vLLM's OPT kernel receives the queries unscaled and scales them itself; attnlens serves the queries and the
    scale the kernel has (eager: pre-scaled queries, scale 1.0). The queries differ by the scale; the scores, and the
    head summaries computed from queries, keys and scale, do not."""
    models = pair("opt", tmp_path_factory)
    assert "not pre-scaled" in models.vllm.support(0).notes["self_attn.attention_queries"]
    read = {}
    for engine, model in (("vllm", models.vllm), ("eager", models.eager)):
        with torch.no_grad(), model.trace(PROMPT):  # the body runs in vLLM's worker: only saves come back
            attn = model.layers[1].self_attn
            queries, keys = attn.attention_queries.clone().save(), attn.attention_keys.clone().save()
            scores = attn.attention_scores.clone().save()
        read[engine] = queries, keys, scores, model.layers[1].self_attn.scale
    (queries, keys, scores, scale), (eager_queries, _, eager_scores, eager_scale) = read["vllm"], read["eager"]
    assert eager_scale == 1.0 and scale == pytest.approx(queries.shape[-1] ** -0.5)
    assert equal.close(queries * scale, eager_queries) and equal.close(scores, eager_scores)
    unmasked = ~attnlens.masked(scores)
    assert torch.allclose((queries @ keys.transpose(-1, -2) * scale)[unmasked], scores[unmasked], atol=1e-5)
    summaries = [
        attnlens.head_summaries(model, [PROMPT], length=8, sequences=2, top_k=1, progress=False)
        for model in (models.vllm, models.eager)
    ]
    assert summaries[0].metrics == summaries[1].metrics
    for metric in summaries[1].metrics:
        assert torch.allclose(summaries[0].get(metric, 1), summaries[1].get(metric, 1), atol=1e-4), metric
