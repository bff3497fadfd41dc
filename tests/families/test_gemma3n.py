"""Gemma3nText (attnlens/families/gemma3n.py): what the shared identities cannot see."""

import torch
from conftest import PROMPT, needs, tiny
from identities import N, perturbed, trace

from attnlens.checks import failures, read_everything


def test_gemma3n_streams_and_the_active_stream():
    needs("gemma3n_text")
    model = tiny("gemma3n_text")
    got = trace(
        model,
        lambda m: {
            "in": m.layers[1].layer_input,
            "norm": m.layers[1].attention_norm_output,
            "mid": m.layers[1].layer_mid,
            "out": m.layers[1].layer_output,
            "next": m.layers[2].layer_input,
        },
    )
    assert got["in"].shape == got["out"].shape == (1, N, 4, 64) and got["mid"].shape == (1, N, 64)
    assert torch.equal(got["out"], got["next"])
    block = model._module.model.layers[1]
    with torch.no_grad():  # the attention reads the active stream's prediction from every stream
        prediction = block.altup.predict(got["in"].permute(2, 0, 1, 3))[0]
        assert torch.allclose(block.input_layernorm(prediction), got["norm"], atol=1e-5)
        assert not torch.allclose(block.input_layernorm(got["in"][:, :, 0]), got["norm"], atol=1e-3)
    assert "AltUp streams" in model.support(1).notes["layer_input"]


def test_gemma3n_correction_and_per_layer_inputs_need_the_block_arguments():
    """With altup_correct_scale and its scale off zero, every identity holds; the per-layer input is what closes the
    last residual add, and the activation-sparse layer's activation is act(topk(gate))."""
    needs("gemma3n_text")
    model = perturbed(
        "gemma3n_text",
        {"correct_output_scale"},
        altup_correct_scale=True,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    )
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, i) for i in range(4)] == [["activation == act(gate(mlp input))"], [], [], []]
    mlp = model._module.model.layers[0].mlp
    with torch.no_grad():
        gate = mlp._gaussian_topk(mlp.gate_proj(saved[(0, "mlp_input")]))
    assert torch.allclose(mlp.act_fn(gate), saved[(0, "mlp_activation")], atol=1e-6)
    assert "activation sparsity 0.95" in model.support(0).notes["mlp.mlp_activation"]
    for i in range(4):
        block, arguments = model._module.model.layers[i], saved[(i, "block_arguments")]
        update = saved[(i, "mlp_output")]
        with torch.no_grad():
            without = model.family.identities.residual_add(
                block,
                "mlp",
                saved[(i, "layer_mid")],
                update,
                **{**arguments, "per_layer_input": torch.zeros_like(arguments["per_layer_input"])},
            )
        assert torch.allclose(without[:, :, 0], saved[(i, "layer_output")][:, :, 0], atol=1e-5)  # the active one
        assert not torch.allclose(without, saved[(i, "layer_output")], atol=1e-3)


def test_gemma3n_shared_keys_and_unscaled_scores():
    needs("gemma3n_text")
    model = tiny("gemma3n_text")
    got = trace(
        model,
        lambda m: {
            (i, name): getattr(m.layers[i].self_attn, name)
            for i in range(4)
            for name in ("attention_queries", "attention_keys", "attention_values", "attention_scores")
        },
    )
    for shared, source in ((2, 0), (3, 1)):
        for name in ("attention_keys", "attention_values"):
            assert torch.equal(got[shared, name], got[source, name])
        assert f"reused from layer {source}" in model.support(shared).notes["self_attn.attention_keys"]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    q, k = got[1, "attention_queries"], got[1, "attention_keys"].repeat_interleave(2, 1)
    assert torch.allclose((q @ k.transpose(2, 3))[..., causal], got[1, "attention_scores"][..., causal], atol=1e-5)
