"""Edits land where they are written and move the logits exactly as recomputing by hand predicts."""

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens

LAYER = 1


def test_ablating_a_head_matches_the_hand_recomputation(family):
    model = tiny(family)
    attn = model.layers[LAYER].self_attn
    head, d = 2, attn.head_dim
    with torch.no_grad():
        with model.trace(PROMPT):
            premix = attn.attention_premix.save()
            clean = model.logits.save()
        with model.trace(PROMPT):
            attn.attention_head_outputs[:, :, head] = 0
            ablated = model.logits.save()
        by_hand = premix.clone()
        by_hand[..., head * d : (head + 1) * d] = 0
        projected = getattr(attn._module, model.family.output_projection)(by_hand)
        with model.trace(PROMPT):
            attn.attention_output = projected
            predicted = model.logits.save()
    assert not torch.allclose(ablated, clean, atol=1e-4)
    assert torch.allclose(ablated, predicted, atol=1e-5)


def test_assigning_keys_leaves_queries_and_values(family):
    model = tiny(family)
    attn = model.layers[LAYER].self_attn
    with torch.no_grad():
        with model.trace(PROMPT):
            q = attn.attention_queries.save()
            v = attn.attention_values.save()
        with model.trace(PROMPT):
            attn.attention_keys = torch.zeros_like(attn.attention_keys)
            q2 = attn.attention_queries.save()
            v2 = attn.attention_values.save()
            probs = attn.attention_probabilities.save()
    assert torch.equal(q, q2) and torch.equal(v, v2)
    # Zero keys give every visible key the same score (soft-capping keeps 0 at 0): uniform rows. Row 3 sees four
    # keys, inside every tiny sliding window.
    row = probs[0, :, 3, :4]
    assert torch.allclose(row, torch.full_like(row, 1 / 4))


def test_keep_masked_changes_scores_without_lifting_the_mask():
    model = tiny("llama")
    attn = model.layers[LAYER].self_attn
    with torch.no_grad():
        with model.trace(PROMPT):
            attn.attention_scores = attnlens.keep_masked(attn.attention_scores, 0.0)
            kept = attn.attention_probabilities.save()
        with model.trace(PROMPT):
            attn.attention_scores[:] = 0  # the trap the docs warn about
            lifted = attn.attention_probabilities.save()
    n = kept.shape[-1]
    causal = torch.ones(n, n).tril().bool()
    assert (kept[..., ~causal] == 0).all()
    assert torch.allclose(kept[0, 0, 3, :4], torch.full((4,), 0.25))
    assert torch.allclose(lifted[0, 0, 3], torch.full((n,), 1 / n))


def test_adding_to_scores_shifts_the_pattern():
    model = tiny("llama")
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_scores[:, :, :, 0] += 20.0
        probs = attn.attention_probabilities.save()
    assert (probs[0, :, 3:, 0] > 0.99).all()
    assert (probs[0, :, 2, 3:] == 0).all()


def test_in_place_edit_of_a_fused_query_view_says_to_assign():
    model = tiny("gpt2")
    attn = model.layers[LAYER].self_attn
    with pytest.raises(attnlens.EditError, match="Assign it instead"):
        with model.trace(PROMPT):
            attn.attention_queries[:, 0] = 0
    with model.trace(PROMPT):
        attn.attention_queries = attn.attention_queries * 0
        probs = attn.attention_probabilities.save()
    assert torch.allclose(probs[0, 0, 3, :4], torch.full((4,), 0.25))
    assert model.support(LAYER).notes["self_attn.attention_queries"].startswith("a view")


def test_editing_probabilities_flows_into_head_outputs():
    model = tiny("qwen3")
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        v = attn.attention_values.save()
        probs = attn.attention_probabilities
        probs[:] = 0
        probs[..., 0] = 1  # every query reads the first token only
        heads = attn.attention_head_outputs.save()
    groups = attn.num_heads // attn.num_kv_heads
    first = v.repeat_interleave(groups, dim=1)[:, :, 0]  # [batch, heads, dim]
    assert torch.allclose(heads, first[:, None].expand_as(heads), atol=1e-6)
