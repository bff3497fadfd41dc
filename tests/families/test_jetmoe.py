"""JetMoe (attnlens/families/jetmoe.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import N, close, saved_for

import attnlens


def test_jetmoe_heads_pair_with_tiled_keys():
    model = tiny("jetmoe")
    saved = saved_for("jetmoe")
    attn = model.layers[1].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 16)
    q, k, v = (saved[(1, name)] for name in ("attention_queries", "attention_keys", "attention_values"))
    assert k.shape == v.shape == (1, 2, N, 16) and q.shape == (1, 4, N, 16)
    scores = saved[(1, "attention_scores")]
    assert torch.equal(
        model.family.score_function().repeat_kv(k, 2)[:, [0, 1, 0, 1]], model.family.score_function().repeat_kv(k, 2)
    )
    interleaved = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(2, 3)) * attn.scale
    visible = scores > torch.finfo(scores.dtype).min
    assert not torch.allclose(interleaved[visible], scores[visible], atol=1e-3)  # transformers' usual pairing is wrong
    value = attnlens.per_head_value(model, attnlens.run_with_cache(model, PROMPT, ["value.1"]), 1)
    assert torch.equal(value.transpose(1, 2), v.repeat(1, 2, 1, 1))


def test_jetmoe_queries_keys_and_values_from_the_router_and_the_experts():
    """Rebuilt from the module's weights: each token's queries by its chosen experts (slot s = the s-th highest router
    logit) for query heads s * kv_heads ..., keys and values by the shared kv_proj, then the rotary embedding."""
    from transformers.models.jetmoe.modeling_jetmoe import apply_rotary_pos_emb

    model = tiny("jetmoe")
    saved = saved_for("jetmoe")
    layer = 2
    module = model.layers[layer].self_attn._module
    x = saved[(layer, "attention_norm_output")][0]  # [seq, hidden]
    chosen = module.experts.router.layer(x).float().topk(2, dim=1).indices  # [seq, top_k], highest first
    weights = module.experts.input_linear.weight  # [experts, kv_heads * head_dim, hidden]
    queries = torch.stack([torch.stack([weights[e] @ x[t] for e in chosen[t]]) for t in range(N)])  # [seq, k, kv*d]
    queries = queries.view(1, N, 4, 16).transpose(1, 2)
    keys, values = module.kv_proj(x[None]).chunk(2, dim=-1)
    keys, values = (t.view(1, N, 2, 16).transpose(1, 2) for t in (keys, values))
    cos, sin = model._module.model.rotary_emb(x[None], torch.arange(N)[None])
    queries, keys = apply_rotary_pos_emb(queries, keys, cos, sin)
    assert torch.allclose(saved[(layer, "attention_queries")], queries, atol=1e-5)
    assert torch.allclose(saved[(layer, "attention_keys")], keys, atol=1e-5)
    assert torch.allclose(saved[(layer, "attention_values")], values, atol=1e-5)


def test_jetmoe_keys_are_a_copy_assigned_back_to_every_tile():
    model = tiny("jetmoe")
    layer = 1
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        held = attn.source.attention_interface_1.inputs[0][2].save()  # what the forward holds: tiled top_k times
        keys = attn.attention_keys.save()
    assert held.shape == (1, 4, N, 16) and torch.equal(held[:, :2], held[:, 2:]) and torch.equal(keys, held[:, :2])
    with torch.no_grad(), model.trace(PROMPT):
        q = attn.attention_queries.save()
        attn.attention_keys = attn.attention_keys * 2
        attn.attention_values = attn.attention_values * 0 + 0.5
        scores = attn.attention_scores.save()
        heads = attn.attention_head_outputs.save()
    assert torch.equal(model.family.score_function().scores(attn.heads, model.config, q, keys * 2, layer), scores)
    assert close(heads, torch.full_like(heads, 0.5))  # every slot's heads read the assigned values
    with pytest.raises(attnlens.EditError, match=r"attention_keys was edited in place.*tile"):
        with torch.no_grad(), model.trace(PROMPT):
            attn.attention_keys.mul_(0)
            attn.attention_scores.save()
    assert "query head j reads key head j % 2" in model.support(layer).notes["self_attn.attention_keys"]


def test_jetmoe_premix_feeds_the_output_experts():
    model = tiny("jetmoe")
    saved = saved_for("jetmoe")
    layer = 0
    attn = model.layers[layer].self_attn
    module = attn._module
    premix, heads = saved[(layer, "attention_premix")], saved[(layer, "attention_head_outputs")]
    assert premix.shape == (1, N, 64) and torch.equal(premix, heads.flatten(2))
    # the output experts are routed by the attention's input: the same premix with another input projects otherwise
    out = model.family.identities.project_routed_output(module, premix, saved[(layer, "attention_norm_output")])
    assert torch.allclose(out, saved[(layer, "attention_output")], atol=1e-6)
    other = model.family.identities.project_routed_output(
        module, premix, saved[(layer, "attention_norm_output")].flip(1)
    )
    assert not torch.allclose(other, out, atol=1e-3)
    with pytest.raises(NotImplementedError, match="routed per token"):
        model.family.identities.project_output(module, premix)
    # an edit of the merged premix reaches the experts: zero heads leave only the experts' bias
    original = module.experts.bias.detach().clone()
    with torch.no_grad():
        module.experts.bias.normal_()
    try:
        with torch.no_grad(), model.trace(PROMPT):
            attn.attention_premix[:] = 0
            out = attn.attention_output.save()
        assert torch.allclose(out, module.experts.bias.expand_as(out))
    finally:
        with torch.no_grad():
            module.experts.bias.copy_(original)


def test_jetmoe_mlp_is_per_expert():
    model = tiny("jetmoe")
    report = model.support(0)
    for name in ("mlp.mlp_activation", "mlp.mlp_neurons"):
        assert report[name].startswith("a sparse mixture of experts") and "JetMoeMoE.forward" in report[name]
    assert report["mlp.mlp_output"] is None


def test_jetmoe_a_tiled_assignment_is_refused_with_the_untiling():
    model = tiny("jetmoe")
    attn = model.layers[0].self_attn
    with pytest.raises(attnlens.EditError, match=r"read before the repetition.*new\[:, :2\]\)"):
        with torch.no_grad(), model.trace(PROMPT):
            attn.attention_keys = torch.zeros(1, 4, N, 16)
