"""OPT (attnlens/families/opt.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import LAYER, at, close, heads, saved_for, visible

import attnlens


def test_opt_queries_are_pre_scaled_and_scores_unscaled():
    model = tiny("opt")
    attn = model.layers[LAYER].self_attn
    module = attn._module
    assert attn.scale == 1.0
    with torch.no_grad():
        q = heads(module.q_proj(at("opt", "attention_norm_output")) * module.head_dim**-0.5, module.head_dim)
    queries, keys = at("opt", "attention_queries"), at("opt", "attention_keys")
    assert close(queries, q)
    n = queries.shape[2]
    masked = torch.where(visible(model.config, model.family, LAYER, n), 0.0, torch.finfo(torch.float32).min)
    assert close(at("opt", "attention_scores"), queries @ keys.transpose(2, 3) + masked)
    notes = model.support(LAYER).notes
    assert notes["self_attn.attention_queries"].startswith("pre-scaled")
    assert "no further factor" in notes["self_attn.attention_scores"]


def test_opt_mlp_values_are_the_flattened_tokens_viewed_back():
    model = tiny("opt")
    block = model.layers[LAYER]._module
    n = at("opt", "layer_input").shape[1]
    assert at("opt", "mlp_activation").shape == (1, n, model.config.ffn_dim)
    with torch.no_grad():
        activation = block.activation_fn(block.fc1(at("opt", "mlp_input")))
    assert close(at("opt", "mlp_activation"), activation)
    assert close(block.final_layer_norm(at("opt", "layer_mid")), at("opt", "mlp_norm_output"))
    order = model.order(LAYER)
    assert order["mlp.mlp_activation"] == order["mlp.mlp_neurons"]
    assert model.support(LAYER).notes["mlp.mlp_output"].startswith("read on the block's flattened")


@pytest.mark.parametrize("how", ["in place", "assigned"])
def test_opt_mlp_output_edits_land(how):
    model = tiny("opt")
    layer = model.layers[LAYER]
    with torch.no_grad(), model.trace(PROMPT):
        mid = layer.layer_mid.save()
        if how == "in place":
            layer.mlp.mlp_output[:] = 0
        else:
            layer.mlp.mlp_output = torch.zeros_like(layer.mlp.mlp_output)
        out = layer.layer_output.save()
        logits = model.logits.save()
    assert torch.equal(out, mid)
    assert not close(logits, saved_for("opt")["logits"])


def test_opt_mlp_values_per_invoke():
    """Batched invokes: each reads and edits its own rows of the flattened tokens."""
    model = tiny("opt")
    other = "Again, world hello"
    assert len(other) == len(PROMPT)
    with torch.no_grad(), model.trace(other):
        alone = model.layers[LAYER].mlp.mlp_output.save()
        alone_logits = model.logits.save()
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPT):
            first = model.layers[LAYER].mlp.mlp_output.save()
            first_logits = model.logits.save()
        with tracer.invoke(other):
            layer = model.layers[LAYER]
            mid = layer.layer_mid.save()
            second = layer.mlp.mlp_output.save()
            layer.mlp.mlp_output = torch.zeros_like(second)
            out = layer.layer_output.save()
    assert close(first, at("opt", "mlp_output")) and close(second, alone)
    assert close(first_logits, saved_for("opt")["logits"]) and not close(second, first)
    assert torch.equal(out, mid) and not close(alone_logits, first_logits)


def test_opt_mlp_values_under_generate():
    model = tiny("opt")
    n = len(model.tokenizer(PROMPT).input_ids)
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:2]:
            layer = model.layers[LAYER]
            steps.append((layer.mlp_input, layer.mlp.mlp_output))
    assert [x.shape[:2] for x, _ in steps] == [(1, n), (1, 1)]
    block = model.layers[LAYER]._module
    with torch.no_grad():
        for x, out in steps:
            assert close(model.family.identities.mlp_forward(block, x), out)


def test_opt_out_of_order_mlp_read_raises():
    model = tiny("opt")
    layer = model.layers[LAYER]
    with pytest.raises(attnlens.OrderError, match="mlp_input"):
        with torch.no_grad(), model.trace(PROMPT):
            layer.mlp.mlp_output.save()
            layer.mlp_input.save()


def test_opt_post_norm_layout_reports_the_norm_placed_values():
    model = tiny("opt", do_layer_norm_before=False)
    report = model.support(LAYER)
    for key in ("attention_norm_output", "layer_mid", "mlp_norm_output", "final_norm_output"):
        assert report[key].startswith("OPT with do_layer_norm_before=False normalises after each sublayer"), key
    assert report["self_attn.attention_queries"] is None and report["layer_output"] is None
