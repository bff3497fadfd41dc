"""Mixture-of-experts layers (Mixtral, Qwen2-MoE, Qwen3-MoE, ERNIE 4.5 MoE; DeepSeek's and MiMo's dense and expert
layers): the routed output and the reasons.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for, trace

import attnlens


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v3", "mimo_v2_flash"])
def test_dense_layers_serve_the_activation_and_moe_layers_say_why_not(case):
    model = tiny(case)
    assert model.support(0)["mlp.mlp_activation"] is None and model.support(0)["mlp.mlp_neurons"] is None
    reason = model.support(1)["mlp.mlp_activation"]
    assert "mixture-of-experts" in reason and "loop over experts" in reason
    with pytest.raises(attnlens.Unavailable, match="loop over experts"):
        with model.trace(PROMPT):
            model.layers[1].mlp.mlp_neurons.save()
    got = trace(model, lambda m: {"a": m.layers[0].mlp.mlp_activation, "out": m.layers[1].mlp.mlp_output})
    assert got["a"].shape == (1, len(PROMPT), model.config.intermediate_size)
    assert got["out"].shape == (1, len(PROMPT), 64)


#: MoE family -> (a sparse MoE layer, a dense layer or None).
MOE = {"mixtral": (1, None), "qwen2_moe": (0, 1), "qwen3_moe": (1, 0), "ernie4_5_moe": (1, 0)}


def moe_by_hand(block, x):
    """The MoE block's output from its weights: top-k routing over every expert, plus any shared expert (gated, or
    added as it is: ERNIE 4.5's shared_experts)."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax((flat @ block.gate.weight.T).float(), dim=-1)
    statics = getattr(block.gate, "moe_statics", None)  # ERNIE 4.5 chooses by the scores plus a correction bias
    _, chosen = (probs if statics is None else statics(probs)).topk(block.gate.top_k, dim=-1)
    top = probs.gather(-1, chosen)
    if getattr(block.gate, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(-1, keepdim=True)
    experts = block.experts
    gate, up = torch.einsum("th,eih->eti", flat, experts.gate_up_proj).chunk(2, dim=-1)
    every = torch.einsum("eti,ehi->eth", experts.act_fn(gate) * up, experts.down_proj)  # [experts, tokens, hidden]
    tokens = torch.arange(flat.shape[0])[:, None]
    out = (every[chosen, tokens] * top[..., None]).sum(1)
    if hasattr(block, "shared_expert"):
        out = out + torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    if getattr(block, "shared_experts", None) is not None:
        out = out + block.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("case", list(MOE))
def test_moe_output_is_the_routed_experts_combined(case):
    model = tiny(case)
    layer, _ = MOE[case]
    saved = saved_for(case)
    block = model.layers[layer]._module.mlp
    out = saved[(layer, "mlp_output")]
    assert out.shape == saved[(layer, "mlp_input")].shape  # a tensor: no router logits ride along
    with torch.no_grad():
        assert close(moe_by_hand(block, saved[(layer, "mlp_input")]), out)


@pytest.mark.parametrize("case", list(MOE))
def test_moe_activations_are_unavailable_with_where_they_live(case):
    model = tiny(case)
    layer, dense = MOE[case]
    experts_class = type(model.layers[layer]._module.mlp.experts).__name__
    for key in ("mlp.mlp_activation", "mlp.mlp_neurons"):
        reason = model.support(layer)[key]
        assert "sparse mixture of experts" in reason and f"mlp.experts ({experts_class}.forward" in reason
    assert "mlp.mlp_activation" not in model.order(layer)
    with pytest.raises(attnlens.Unavailable, match="sparse mixture of experts"):
        with model.trace(PROMPT):
            model.layers[layer].mlp.mlp_neurons.save()
    if dense is not None:  # a dense layer of the same model serves its activation
        assert model.support(dense)["mlp.mlp_activation"] is None
        assert (dense, "mlp_activation") in saved_for(case)
    if case == "qwen2_moe":
        assert "shared expert" in model.support(layer)["mlp.mlp_activation"]


@pytest.mark.parametrize("case", list(MOE))
def test_ablating_the_moe_output_leaves_the_residual(case):
    model = tiny(case)
    layer, _ = MOE[case]
    with torch.no_grad(), model.trace(PROMPT):
        mid = model.layers[layer].layer_mid.save()
        model.layers[layer].mlp.mlp_output[:] = 0
        out = model.layers[layer].layer_output.save()
    assert torch.equal(mid, out)
