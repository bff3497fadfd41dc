"""`support(layer).analyses` lists every analysis and, where one is not served, the reason the analysis itself then
raises: the support table and the refusal are one fact."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.analysis import ANALYSES, attribution, attribution_patching, knock_out, logit_difference, patch
from attnlens.analysis.reasons import model_reason


@pytest.fixture(scope="module")
def sdpa():
    return tiny("llama", attn_implementation="sdpa")


def test_every_analysis_is_listed_and_served_on_eager_attention():
    model = tiny("llama")
    for layer in range(model.num_layers):
        report = model.support(layer)
        assert list(report.analyses) == list(ANALYSES)
        assert set(report.analyses.values()) == {None}
    text = str(model.support(1))
    for name in ("attribution", "patch:head_positions", "knock_out"):
        assert f"analysis: {name}" in text


def test_what_support_refuses_is_what_the_analysis_raises(sdpa):
    """sdpa never forms the pattern: patching it, knocking it out and splitting attribution by head are refused with
    the pattern's own reason, while what reads only head outputs or the residual stays served."""
    report = sdpa.support(0)
    pattern = report["self_attn.attention_probabilities"]
    assert pattern is not None
    for name in ("attribution", "patch:patterns", "attribution_patching:patterns", "knock_out"):
        assert pattern in report.analyses[name], name
    for name in ("lens", "patch:heads", "patch:residual", "attribution_patching:head_positions"):
        assert report.analyses[name] is None, name
    metric = logit_difference(sdpa, "a", "b")
    with pytest.raises(attnlens.Unavailable) as raised:
        patch(sdpa, PROMPT, PROMPT, metric, over="patterns")
    assert report.analyses["patch:patterns"] in str(raised.value)
    with pytest.raises(attnlens.Unavailable) as raised:
        attribution_patching(sdpa, PROMPT, PROMPT, metric, over="patterns")
    assert report.analyses["attribution_patching:patterns"] in str(raised.value)
    with pytest.raises(attnlens.Unavailable, match="attention_probabilities is unavailable"):
        with torch.no_grad(), sdpa.trace(PROMPT):
            knock_out(sdpa, 0, queries=[3], keys=[0])
    with pytest.raises(attnlens.Unavailable, match="not split by head"):
        attribution(sdpa, PROMPT, target="a", layers=[0])


def test_a_model_without_a_final_norm_serves_patching_but_no_attribution():
    model = tiny("git")  # no final norm: nothing to freeze for attribution or the lens; patching reads only values
    whole = model_reason(model)
    assert whole is not None
    report = model.support(0)
    assert report.analyses["attribution"] == report.analyses["lens"] == whole
    assert report.analyses["patch:heads"] is None


def test_importing_attnlens_alone_registers_the_analyses():
    """The access layer names no analysis; importing attnlens (which imports attnlens.analysis) fills the hook."""
    script = (
        "import attnlens\n"
        "from attnlens import support\n"
        "assert [answer.__module__ for answer in support._ANALYSES] == ['attnlens.analysis.entry']\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, env=os.environ.copy())


def test_the_vllm_output_projection_is_read_once_per_weights():
    """vLLM's packed projection is read by running its matmul on the identity, once per weights: a second read is the
    cached matrix, an in-place edit of the weight reads it anew (a Linear stands in for vLLM's module here)."""
    from attnlens.analysis.vllm import projection_weights

    class Kernel:
        calls = 0

        def apply(self, layer, x, bias):
            Kernel.calls += 1
            return torch.nn.functional.linear(x, layer.weight, bias)

    projection = torch.nn.Linear(6, 4, bias=True)
    projection.quant_method = Kernel()
    matrix, bias = projection_weights(projection, 6)
    assert torch.equal(matrix, projection.weight.detach()) and torch.equal(bias, projection.bias.detach())
    again, _ = projection_weights(projection, 6)
    assert again is matrix and Kernel.calls == 1
    with torch.no_grad():
        projection.weight.mul_(2)
    edited, _ = projection_weights(projection, 6)
    assert Kernel.calls == 2 and torch.equal(edited, projection.weight.detach())
