"""GraniteSWA (attnlens/families/granite_swa.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import tiny
from identities import close, saved_for


@pytest.mark.parametrize("case", ["granite_swa", "granitemoe_swa"])
def test_granite_swa_gate_is_the_sink_factor(case):
    model, saved = tiny(case), saved_for(case)
    module = model.layers[0].self_attn._module
    scores = saved[(0, "attention_scores")]
    factor = torch.sigmoid(torch.logsumexp(scores, -1) - module.sinks.view(1, -1, 1))
    gate = saved[(0, "attention_gate")]
    assert close(gate, factor.transpose(1, 2)[..., None].expand_as(gate))
    assert close(saved[(0, "attention_probabilities")].sum(-1), torch.ones_like(factor))
    assert model.support(0)["self_attn.attention_sinks"].startswith("the sink is applied after the mix")
