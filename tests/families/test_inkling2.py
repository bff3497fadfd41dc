"""Inkling2, Inkling2Loop (attnlens/families/inkling2.py): what the shared identities cannot see."""

import torch
from conftest import tiny
from identities import N, ids, trace


def test_inkling2_the_blocks_mlp_input_module_moves_aside_for_the_value():
    model = tiny("inkling2_text")
    layer = model.layers[1]
    assert type(layer.E_mlp_input._module).__name__ == "Inkling2BlockAttentionResidual"
    got = trace(
        model,
        lambda m: {"mid": m.layers[1].layer_mid, "mix": m.layers[1].E_mlp_input.output, "x": m.layers[1].mlp_input},
    )
    with torch.no_grad():
        assert torch.allclose(layer._module.post_attention_layernorm(got["mix"][0]), got["x"], atol=1e-6)
    assert got["mid"].dtype == torch.float32


def test_inkling2_sinks_are_each_querys_own_logit():
    model = tiny("inkling2_text")
    module = model.layers[0].self_attn._module
    got = trace(
        model,
        lambda m: {
            "x": m.layers[0].attention_norm_output,
            "s": m.layers[0].self_attn.attention_scores,
            "z": m.layers[0].self_attn.attention_sinks,
            "p": m.layers[0].self_attn.attention_probabilities,
        },
    )
    with torch.no_grad():
        logits = module.sink_proj(got["x"]).transpose(1, 2)  # [batch, heads, query]
    by_hand = torch.cat([got["s"], logits[..., None]], dim=-1).softmax(-1)
    assert torch.allclose(by_hand[..., -1], got["z"], atol=1e-6)
    assert torch.allclose(by_hand[..., :-1], got["p"], atol=1e-6)
    assert got["z"].std(-1).min() > 0  # not one logit per head: it varies by query


def test_inkling2_full_layers_read_three_inputs_and_the_depth_mixes_are_said():
    model = tiny("inkling2_text")
    block = model.layers[1]._module
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "q": m.layers[1].self_attn.attention_queries})
    with torch.no_grad():
        queries = block.self_attn.q_proj(got["x"], torch.arange(N)[None])
    assert torch.allclose(queries, got["q"], atol=1e-6)
    assert "k_input_layernorm" in model.support(1).notes["attention_norm_output"]
    assert "depth" in model.support(0)["mlp_norm_output"] and "final_input" in model.support(0)["final_norm_output"]
    assert "restarts" in model.support(0).notes["layer_mid"] and "restarts" in model.support(2).notes["layer_mid"]
    assert "restarts" not in model.support(1).notes["layer_mid"]


def test_inkling2_loop_serves_the_blocks_run_once_and_says_why_not_the_looped_one():
    model = tiny("inkling2_loop_text")
    module = model._module
    calls = []
    hook = module.model.layers[1].register_forward_hook(lambda mod, args, out: calls.append(out.detach()))
    try:
        with torch.no_grad():
            module(ids())
    finally:
        hook.remove()
    assert len(calls) == model.config.loop_num_passes == 2 and not torch.allclose(calls[0], calls[1], atol=1e-3)
    got = trace(model, lambda m: {"x": m.layers[2].layer_input})
    assert torch.allclose(got["x"], calls[-1], atol=1e-6)  # the block after the loop reads the last pass
    reason = model.support(1)["self_attn.attention_probabilities"]
    assert "loop_num_passes=2 times" in reason and "2 different values" in reason
    assert model.support(1).available == ["embeddings", "logits"]
    assert "last pass" in model.support(2).notes["layer_input"]
