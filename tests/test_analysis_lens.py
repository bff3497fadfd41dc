"""The logit lens reads each residual row through the family's own final norm and unembedding: the last
layer_output's lens is the logits (before any soft-cap), and an early site's lens is the final norm module applied to
that residual, on every family that serves it."""

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny
from test_analysis_attribution import close, run_logits

import attnlens
from attnlens.analysis import logit_lens
from attnlens.analysis.reasons import model_reason


@pytest.mark.parametrize("case", ALL_CASES)
def test_last_site_is_the_logits(case):
    model = tiny(case)
    if model_reason(model) is not None:
        with pytest.raises(attnlens.Unavailable, match="logit lens"):
            logit_lens(model, PROMPT)
        return
    found = logit_lens(model, PROMPT, rows=[-1, 2], tokens=["a"])
    assert found.sites[-1] == (model.num_layers - 1, "layer_output")
    assert close(found.last, run_logits(model)[found.rows])
    assert close(found.token_logits[-1, :, 0], found.last[:, model.tokenizer("a").input_ids[-1]])


@pytest.mark.parametrize("case", ["llama", "gpt2", "gemma2", "granite"])
def test_an_early_site_through_the_models_own_modules(case):
    model = tiny(case)
    with torch.no_grad(), model.trace(PROMPT):
        residual = model.layers[1].layer_input.save()
    norm = model._module.get_submodule(model.family.final_norm)
    with torch.no_grad():
        expected = model._module.get_output_embeddings()(norm(residual))[0, [-1]]
    scaling = getattr(model.config, "logits_scaling", None)
    expected = expected / scaling if scaling else expected
    found = logit_lens(model, PROMPT, layers=[1])
    site = found.sites.index((1, "layer_input"))
    k = found.top_ids.shape[-1]
    assert close(found.top_values[site, 0], expected[0].topk(k).values)
    assert found.top_ids[site, 0].tolist() == expected[0].topk(k).indices.tolist()


def test_results_read(tmp_path):
    found = logit_lens(tiny("llama"), PROMPT, tokens=["a", "b"], top_k=3)
    assert "logit lens" in str(found) and len(found.to_rows()) == len(found.sites)
    assert found.plot(tmp_path / "lens.png").stat().st_size > 0
    with pytest.raises(ValueError, match="top_k"):
        logit_lens(tiny("llama"), PROMPT, top_k=0)
