"""Gemma 3n (AltUp streams, LAuReL, per-layer inputs), ZAYA1 (affine residual adds, a router state carried between
blocks), Doge (a dynamic mask computed from the values) and MiniMax-M3 (block-sparse indexed layers): what the shared
identities cannot see on the tiny recipes, whose learned scales start at the identity."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import trace

import attnlens
from attnlens import heads
from attnlens.checks import failures, read_everything
from attnlens.models import char_tokenizer, tiny_model

N = len(PROMPT)


def perturbed(case, names, **config):
    """A fresh tiny model of `case` with the parameters called `names` (anywhere) moved off their initial values."""
    model = attnlens.models.tiny(case, **config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model._module.named_parameters():
            if name.rsplit(".", 1)[-1] in names:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model


# --- Gemma 3n -------------------------------------------------------------------------------------------------------


def test_gemma3n_streams_and_the_active_stream():
    needs("gemma3n_text")
    model = tiny("gemma3n_text")
    got = trace(model, lambda m: {"in": m.layers[1].layer_input, "norm": m.layers[1].attention_norm_output,
                                  "mid": m.layers[1].layer_mid, "out": m.layers[1].layer_output,
                                  "next": m.layers[2].layer_input})
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
    model = perturbed("gemma3n_text", {"correct_output_scale"}, altup_correct_scale=True,
                      activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0])
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
            without = model.family.residual_add(block, "mlp", saved[(i, "layer_mid")], update, **{
                **arguments, "per_layer_input": torch.zeros_like(arguments["per_layer_input"])})
        assert torch.allclose(without[:, :, 0], saved[(i, "layer_output")][:, :, 0], atol=1e-5)  # the active one
        assert not torch.allclose(without, saved[(i, "layer_output")], atol=1e-3)


def test_gemma3n_shared_keys_and_unscaled_scores():
    needs("gemma3n_text")
    model = tiny("gemma3n_text")
    got = trace(model, lambda m: {(i, name): getattr(m.layers[i].self_attn, name) for i in range(4)
                                  for name in ("attention_queries", "attention_keys", "attention_values",
                                               "attention_scores")})
    for shared, source in ((2, 0), (3, 1)):
        for name in ("attention_keys", "attention_values"):
            assert torch.equal(got[shared, name], got[source, name])
        assert f"reused from layer {source}" in model.support(shared).notes["self_attn.attention_keys"]
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    q, k = got[1, "attention_queries"], got[1, "attention_keys"].repeat_interleave(2, 1)
    assert torch.allclose((q @ k.transpose(2, 3))[..., causal], got[1, "attention_scores"][..., causal], atol=1e-5)


# --- ZAYA1 ----------------------------------------------------------------------------------------------------------

ZAYA_SCALES = {"hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias"}


def test_zaya_affine_residual_adds_and_the_router_state():
    needs("zaya")
    model = perturbed("zaya", ZAYA_SCALES)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    family = model.family
    family.residual_add = lambda block, sublayer, stream, update, **arguments: stream + update
    try:  # a plain sum misses the learned scales
        assert all("layer input + attention output == layer mid" in failures(model, saved, i) for i in range(3))
    finally:
        del family.residual_add
    for i in (1, 2):  # the router adds the state the previous block hands on: without it, other experts win
        mlp = model._module.model.layers[i].mlp
        assert saved[(i, "block_arguments")]["router_state"] is not None
        with torch.no_grad():
            alone = mlp(saved[(i, "mlp_input")])[0]
        assert not torch.allclose(alone, saved[(i, "mlp_output")], atol=1e-4)
    assert saved[(0, "block_arguments")]["router_state"] is None


def test_zaya_sliding_layers():
    needs("zaya")
    model = tiny("zaya")
    got = trace(model, lambda m: {i: m.layers[i].self_attn.attention_probabilities for i in (0, 1)})
    last = got[0][0, :, -1]
    assert (last[:, :-4] == 0).all() and (last[:, -4:] > 0).all()
    assert (got[1][0, :, -1] > 0).all()
    assert model.family.sliding_window(model.config, 0) == 4 and model.family.sliding_window(model.config, 1) is None


# --- Doge -----------------------------------------------------------------------------------------------------------


def test_doge_dynamic_mask_from_the_values():
    needs("doge")
    model = perturbed("doge", {"A", "input_residual", "post_attention_residual"})
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    attn = model.layers[1].self_attn
    q, k, v, s = (saved[(1, name)] for name in ("attention_queries", "attention_keys", "attention_values",
                                                "attention_scores"))
    dynamic = attn.heads.dynamic_mask(v)
    assert dynamic.shape == (1, 2, N) and dynamic.std() > 1e-3  # it varies with the key
    plain = model.family.scores(attn.heads, model.config, q, k, 1, values=torch.zeros_like(v))
    assert not torch.allclose(plain, s, atol=1e-3)  # the values matter
    with pytest.raises(ValueError, match="needs the layer's values"):
        model.family.scores(attn.heads, model.config, q, k, 1)
    assert "values" in heads.why_not(model, 1)
    assert "dynamic mask" in model.support(1).notes["self_attn.attention_scores"]


def test_doge_keep_window_masks_the_smallest_dynamic_mask():
    needs("doge")
    model = perturbed("doge", {"A"}, keep_window_size=5)
    got = trace(model, lambda m: {name: getattr(m.layers[0].self_attn, name) for name in (
        "attention_queries", "attention_keys", "attention_values", "attention_scores", "attention_probabilities")})
    probs = got["attention_probabilities"][0]
    assert ((probs > 0).sum(-1) <= 5).all() and ((probs > 0).sum(-1)[:, -1] == 5).all()
    rebuilt = model.family.scores(model.layers[0].self_attn.heads, model.config, got["attention_queries"],
                                  got["attention_keys"], 0, values=got["attention_values"])
    assert torch.equal(rebuilt == torch.finfo(rebuilt.dtype).min, got["attention_scores"] == rebuilt.min())
    assert torch.allclose(rebuilt, got["attention_scores"], atol=1e-5)


def test_doge_sdpa_is_not_rebuilt_and_cdmoe_layers():
    needs("doge")
    sdpa = attnlens.StandardizedTransformer(tiny_model("doge", attn_implementation="sdpa"),
                                            tokenizer=char_tokenizer(), rebuild_patterns=True)
    assert "depend on the values" in sdpa.support(0)["self_attn.attention_probabilities"]
    moe = attnlens.models.tiny("doge", is_moe=True, num_experts=16, num_experts_per_tok=4)
    saved = read_everything(moe, PROMPT)
    assert [failures(moe, saved, i) for i in range(3)] == [[], [], []]
    assert "CDMoE" in moe.support(0)["mlp.mlp_neurons"] and "view(2" in moe.support(0).notes["mlp.mlp_output"]


# --- MiniMax-M3 -----------------------------------------------------------------------------------------------------


def test_minimax_m3_indexer_masks_the_blocks_it_does_not_choose():
    needs("minimax_m3_vl_text")
    model = tiny("minimax_m3_vl_text", index_topk_blocks=2)
    config = model.config
    with torch.no_grad(), model.trace(PROMPT):  # its own trace: the values are read inside the attention's .source
        chosen = model.layers[1].self_attn.indexer.output.save()
    got = trace(model, lambda m: {name: getattr(m.layers[1].self_attn, name) for name in (
        "attention_queries", "attention_keys", "attention_scores", "attention_probabilities")})
    block = torch.arange(N) // config.index_block_size
    picked = (block[None, None, None, :, None] == chosen[..., None, :]).any(-1)  # [1, kv groups, q, k]
    sees = (picked & torch.ones(N, N, dtype=torch.bool).tril()).repeat_interleave(2, dim=1)
    assert not sees[..., torch.ones(N, N, dtype=torch.bool).tril()].all()  # the choice binds
    probs, scores = got["attention_probabilities"], got["attention_scores"]
    assert torch.equal(probs > 0, sees)
    rebuilt = model.family.scores(model.layers[1].self_attn.heads, config, got["attention_queries"],
                                  got["attention_keys"], 1)
    assert torch.allclose(rebuilt[sees], scores[sees], atol=1e-5)
    notes = model.support(1).notes
    assert "index_topk_blocks=2" in notes["self_attn.attention_probabilities"]
    assert "self_attn.attention_scores" not in model.support(0).notes  # a full-attention layer
    assert "inline" in model.support(0)["mlp.mlp_activation"] and model.support(0)["mlp.mlp_neurons"] is None
