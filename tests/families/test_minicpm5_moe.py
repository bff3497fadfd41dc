"""MiniCPM5Moe (attnlens/families/minicpm5_moe.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import N, close, merged, rope, saved_for, trace

import attnlens
from attnlens.families.minicpm5_moe import MiniCPM5Moe
from attnlens.locations import Operation
from attnlens.models import char_tokenizer, tiny_model

CASE = "minicpm5_moe"
#: The tiny layout: mlp_layer_types ["dense", "sparse", "dense"].
DENSE, SPARSE = (0, 2), 1


def _q_gate(model, layer, x):
    """q_gate_proj(x) split per head into its query half and its gate half (each [b, s, heads, head_dim])."""
    module = model.layers[layer].self_attn._module
    return module.q_gate_proj(x).unflatten(-1, (-1, 2 * module.head_dim)).chunk(2, dim=-1)


@pytest.mark.parametrize("layer", [DENSE[0], SPARSE])
def test_queries_and_gate_are_the_two_halves_of_each_heads_q_gate_slice(layer):
    """The query is the first head_dim channels of each head's slice of q_gate_proj, rotated; the gate is the sigmoid
    of the last head_dim: what the identities take on trust."""
    model, saved = tiny(CASE), saved_for(CASE)
    x = saved[(layer, "attention_norm_output")]
    with torch.no_grad():
        query, gate = _q_gate(model, layer, x)
        keys = saved[(layer, "attention_keys")]
        rotated, _ = rope(model, layer, query.transpose(1, 2), keys)
    assert saved[(layer, "attention_gate")].shape == (1, N, 4, 32)  # head_dim 32: heads * head_dim is not hidden_size
    assert close(saved[(layer, "attention_gate")], torch.sigmoid(gate))
    assert close(saved[(layer, "attention_queries")], rotated)
    assert not close(saved[(layer, "attention_gate")], torch.sigmoid(query), atol=1e-2)  # the halves are distinct


def test_premix_is_the_merged_heads_times_the_sigmoid_not_the_plain_merge():
    model, saved = tiny(CASE), saved_for(CASE)
    x = saved[(SPARSE, "attention_norm_output")]
    heads, premix = saved[(SPARSE, "attention_head_outputs")], saved[(SPARSE, "attention_premix")]
    with torch.no_grad():
        _, gate = _q_gate(model, SPARSE, x)
        output = model.layers[SPARSE].self_attn._module.o_proj(premix)
    assert close(premix, merged(heads * torch.sigmoid(gate)))
    assert not close(premix, merged(heads), atol=1e-2)  # head outputs are read before the gate
    assert close(saved[(SPARSE, "attention_output")], output)


def _logits_with_gate_preactivation(model, layer, channels):
    """The plain module's logits with q_gate_proj's gate half pushed to +-1e4 where `channels` ([heads, head_dim] of
    +1, -1 or 0) says: the sigmoid is then exactly 1 or 0 there, untouched elsewhere. No attnlens involved."""
    module = model.layers[layer].self_attn._module

    def hook(_, __, output):
        per_head = output.unflatten(-1, (-1, 2 * module.head_dim)).clone()
        gate = per_head[..., module.head_dim :]
        per_head[..., module.head_dim :] = torch.where(channels != 0, channels * 1e4, gate)
        return per_head.flatten(-2)

    handle = module.q_gate_proj.register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model._module(**model.tokenizer(PROMPT, return_tensors="pt")).logits
    finally:
        handle.remove()


def test_an_assigned_or_in_place_gate_moves_the_logits_as_the_forward_does():
    model = tiny(CASE)
    ones = torch.ones(4, 32)
    expected = _logits_with_gate_preactivation(model, SPARSE, ones)
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[SPARSE].self_attn
        attn.attention_gate = torch.ones_like(attn.attention_gate)
        assigned = model.logits.save()
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[SPARSE].self_attn.attention_gate[:] = 1
        in_place = model.logits.save()
    assert close(assigned, expected) and close(in_place, expected)
    assert not close(saved_for(CASE)["logits"], expected, atol=1e-3)  # the edit matters


def test_an_edited_head_output_is_gated_by_its_own_heads_gate():
    """Zeroing head 2's output equals closing head 2's gate: the head axis of the head outputs is the gate's."""
    model = tiny(CASE)
    closed = torch.zeros(4, 32)
    closed[2] = -1
    expected = _logits_with_gate_preactivation(model, DENSE[0], closed)
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[DENSE[0]].self_attn.attention_head_outputs[:, :, 2] = 0
        got = model.logits.save()
    assert close(got, expected)
    other = torch.zeros(4, 32)
    other[1] = -1
    assert not close(got, _logits_with_gate_preactivation(model, DENSE[0], other), atol=1e-3)


def test_dense_and_sparse_layers_serve_what_they_say():
    model, saved = tiny(CASE), saved_for(CASE)
    for layer in DENSE:
        assert model.support(layer)["mlp.mlp_activation"] is None and model.support(layer)["mlp.mlp_neurons"] is None
        assert saved[(layer, "mlp_neurons")].shape == (1, N, model.config.intermediate_size)
        assert "mlp.mlp_output" not in model.support(layer).notes
    for key in ("mlp.mlp_activation", "mlp.mlp_neurons"):
        reason = model.support(SPARSE)[key]
        assert "mlp.experts (MiniCPM5MoeExperts.forward" in reason and "mlp.shared_experts" in reason
    assert (SPARSE, "mlp_neurons") not in saved
    with pytest.raises(attnlens.Unavailable, match="sparse mixture of experts"):
        with model.trace(PROMPT):
            model.layers[SPARSE].mlp.mlp_neurons.save()
    note = model.support(SPARSE).notes["mlp.mlp_output"]
    assert "routed_scaling_factor=3.66" in note and "their scores renormalised" in note


def test_the_layer_kinds_follow_mlp_layer_types_and_first_k_dense_replace():
    needs(CASE)
    from transformers import MiniCPM5MoeConfig

    family = MiniCPM5Moe()
    config = MiniCPM5MoeConfig(num_hidden_layers=4, first_k_dense_replace=2)  # the released spelling: a dense prefix
    assert config.mlp_layer_types == ["dense", "dense", "sparse", "sparse"]
    assert [("moe" in family.layer_kind(config, layer)) for layer in range(4)] == [False, False, True, True]
    assert "mlp_neurons" in family.unavailable(config, 2) and "mlp_neurons" not in family.unavailable(config, 1)
    unnormalised = MiniCPM5MoeConfig(num_hidden_layers=2, norm_topk_prob=False)
    assert "their scores not renormalised" in family.notes(unnormalised, 1)["mlp_output"]


def _moe_by_hand(block, x):
    """DeepSeek-V3's routing from the block's weights: sigmoid scores, top-k by score + correction bias, the chosen
    scores renormalised and scaled, plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(flat.float() @ block.gate.weight.float().T)
    chosen = (scores + block.gate.e_score_correction_bias).topk(block.gate.top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * block.config.routed_scaling_factor
    experts = block.experts
    gate, up = torch.einsum("th,eih->eti", flat, experts.gate_up_proj).chunk(2, dim=-1)
    every = torch.einsum("eti,ehi->eth", experts.act_fn(gate) * up, experts.down_proj)
    out = (every[chosen, torch.arange(flat.shape[0])[:, None]] * weights[..., None]).sum(1)
    return (out + block.shared_experts(flat)).view_as(x)


def test_the_moe_output_is_the_biased_routing_plus_the_shared_experts():
    needs(CASE)
    model = attnlens.models.tiny(CASE)  # its own copy: the correction bias is moved below
    block = model.layers[SPARSE]._module.mlp
    torch.manual_seed(3)
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(4))  # it changes which experts run, not their weights
    got = trace(model, lambda m: {"x": m.layers[SPARSE].mlp_input, "out": m.layers[SPARSE].mlp.mlp_output})
    with torch.no_grad():
        assert close(_moe_by_hand(block, got["x"]), got["out"])
        block.gate.e_score_correction_bias.zero_()
        assert not close(_moe_by_hand(block, got["x"]), got["out"], atol=1e-3)  # the bias did move the choice


def test_the_gate_location_is_checked_at_load():
    needs(CASE)

    class Moved(MiniCPM5Moe):
        def locations(self):
            gate = Operation(("gate_states_sigmoid_0",), anchor="torch.sigmoid(gate)")
            return {**super().locations(), "attention_gate": gate}

    with pytest.raises(attnlens.LocationDrift, match=r"value attention_gate: .*'torch.sigmoid\(gate\)'"):
        attnlens.StandardizedTransformer(tiny_model(CASE), tokenizer=char_tokenizer(), family=Moved)


def test_sdpa_serves_the_same_gate_head_outputs_and_premix():
    eager, sdpa = tiny(CASE), tiny(CASE, attn_implementation="sdpa")
    assert sdpa.support(SPARSE)["self_attn.attention_gate"] is None
    assert "attn_implementation='eager'" in sdpa.support(SPARSE)["self_attn.attention_probabilities"]
    names = ("attention_head_outputs", "attention_gate", "attention_premix")
    got = [trace(m, lambda m: {n: getattr(m.layers[SPARSE].self_attn, n) for n in names}) for m in (eager, sdpa)]
    assert all(close(got[0][n], got[1][n], atol=1e-5) for n in names)


def test_generate_reads_the_gate_on_every_step():
    model = tiny(CASE)
    attn = model.layers[SPARSE].self_attn
    with torch.no_grad(), model.generate("Hello world", max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        shapes = list().save()
        for _ in tracer.iter[:3]:
            shapes.append((tuple(attn.attention_probabilities.shape), tuple(attn.attention_gate.shape)))
    assert shapes == [((1, 4, 11, 11), (1, 11, 4, 32)), ((1, 4, 1, 12), (1, 1, 4, 32)), ((1, 4, 1, 13), (1, 1, 4, 32))]


def test_vllm_refuses_naming_what_vllm_lacks():
    family = MiniCPM5Moe()
    refusal = family.vllm.refused(family, CASE)
    assert refusal.startswith("vLLM 0.32 has no MiniCPM5 MoE") and "MiniCPM5MoeForCausalLM" in refusal
    vllm_registry = pytest.importorskip("vllm.model_executor.models.registry")  # where vLLM is installed: still true
    import transformers

    # neither spelling of the architecture (the config maps the older MiniCPM5MoEForCausalLM onto the newer)
    assert not {"MiniCPM5MoeForCausalLM", "MiniCPM5MoEForCausalLM"} & set(vllm_registry._VLLM_MODELS)
    assert not hasattr(transformers, "MiniCPM5MoeConfig")
