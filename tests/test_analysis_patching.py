"""Activation patching and attribution patching: patching a run into itself changes nothing, patching every piece
gives the clean metric, a grid is computed a batch of patches per forward, and the estimate agrees with the real
patches on a tiny model to first order."""

import pytest
import torch
from conftest import tiny

from attnlens.analysis import agreement, attribution_patching, logit_difference, patch
from attnlens.analysis.patching import OVER, _run, clean_values

CLEAN, CORRUPT = "Hello world, again", "Jello world, agaim"


@pytest.fixture(scope="module")
def model():
    return tiny("llama")


@pytest.mark.parametrize("over", list(OVER))
def test_a_run_patched_into_itself_changes_nothing(model, over):
    metric = logit_difference(model, "a", "b")
    grid = patch(model, CLEAN, CLEAN, metric, over=over, batch_size=32)
    assert torch.allclose(grid.values, torch.full_like(grid.values, grid.clean), atol=1e-5)
    assert grid.clean == pytest.approx(grid.corrupt, abs=1e-6)


def test_patching_every_position_gives_the_clean_metric(model):
    """The first block's input at every position is the whole clean run (head outputs alone are not: the corrupted
    tokens still reach the MLPs through the residual)."""
    metric = logit_difference(model, "a", "b")
    ids = model.tokenizer(CLEAN, return_tensors="pt").input_ids[0]
    corrupt = model.tokenizer(CORRUPT, return_tensors="pt").input_ids[0]
    sources = clean_values(model, ids, "layer_input", [0])
    value = _run(model, corrupt, metric, "layer_input", [[(0, p) for p in range(len(ids))]], sources, 1)
    clean = _run(model, ids, metric, "layer_input", [[]], sources, 1)
    assert float(value[0]) == pytest.approx(float(clean[0]), abs=1e-5)
    grid = patch(model, CLEAN, CORRUPT, metric, over="residual", layers=[0], batch_size=32)
    changed = [p for p in range(len(ids)) if ids[p] != corrupt[p]]
    untouched = [p for p in range(len(ids)) if p not in changed]
    assert torch.allclose(grid.values[0, untouched], torch.full((len(untouched),), grid.corrupt), atol=1e-5)


def test_the_grid_is_one_patch_per_row(model):
    metric = logit_difference(model, "a", "b")
    grid = patch(model, CLEAN, CORRUPT, metric, batch_size=5)
    assert grid.values.shape == (3, 4) and grid.forwards == 2 + 3  # 12 patches, 5 per forward
    clean = clean_values(
        model, model.tokenizer(CLEAN, return_tensors="pt").input_ids[0], "self_attn.attention_head_outputs", [1]
    )[1]
    with torch.no_grad(), model.trace(CORRUPT):  # one patch by hand
        model.layers[1].self_attn.attention_head_outputs[:, :, 2] = clean[:, :, 2]
        by_hand = metric(model.logits).save()
    assert float(grid.values[1, 2]) == pytest.approx(float(by_hand[0]), abs=1e-5)
    assert not torch.allclose(grid.values, torch.full_like(grid.values, grid.corrupt))
    positions = patch(model, CLEAN, CORRUPT, metric, over="head_positions", layers=[2], batch_size=64)
    assert positions.values.shape == (1, 4, 18)


def test_attribution_patching_agrees_to_first_order(model):
    metric = logit_difference(model, "a", "b")
    real = patch(model, CLEAN, CORRUPT, metric, over="head_positions", batch_size=64)
    estimate = attribution_patching(model, CLEAN, CORRUPT, metric, over="head_positions")
    assert estimate.values.shape == real.values.shape
    assert estimate.corrupt == pytest.approx(real.corrupt, abs=1e-5)
    assert agreement(real, estimate) > 0.5
    itself = attribution_patching(model, CLEAN, CLEAN, metric)
    assert torch.allclose(itself.effect, torch.zeros_like(itself.effect))


def test_bad_input(model, tmp_path):
    metric = logit_difference(model, "a", "b")
    with pytest.raises(ValueError, match="same length"):
        patch(model, CLEAN, "Hi", metric)
    with pytest.raises(ValueError, match="over must be one of"):
        patch(model, CLEAN, CORRUPT, metric, over="neurons")
    grid = patch(model, CLEAN, CORRUPT, metric, batch_size=12)
    assert "activation patching" in str(grid) and len(grid.to_rows()) == 12
    assert grid.plot(tmp_path / "grid.png").stat().st_size > 0
