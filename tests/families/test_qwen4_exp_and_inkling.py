"""Qwen4-Exp (hyper-connection streams, the QSA indexer, PLE layers, the multimodal composite) and Inkling (short
convolutions after each sublayer, a hidden-state-conditioned relative position bias in the scores): what the shared
identities cannot see."""

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import trace

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.qwen4_exp import sums_masks
from attnlens.models import char_tokenizer, tiny_model

N = len(PROMPT)


def ids(prompt=PROMPT):
    return char_tokenizer()(prompt, return_tensors="pt").input_ids


# --- Qwen4-Exp ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["qwen4_exp_text", "qwen4_exp"])
def test_qwen4_exp_streams_are_the_flat_residual_per_stream(case):
    model = tiny(case)
    count, hidden = 2, model.config.get_text_config().hidden_size
    got = trace(model, lambda m: {"e": m.embeddings, "x0": m.layers[0].layer_input, "o": m.layers[2].layer_output,
                                  "f": m.final_norm_output})
    assert got["x0"].shape == (1, N, count, hidden)
    # the model repeats the embeddings into every stream before the first block
    assert torch.equal(got["x0"], got["e"][:, :, None].expand(-1, -1, count, -1))
    mixer = model._module.get_submodule(model.family.final_norm)
    with torch.no_grad():
        assert torch.allclose(mixer(got["o"].flatten(-2)), got["f"], atol=1e-6)


def test_qwen4_exp_an_edit_of_a_stream_lands():
    model = tiny("qwen4_exp_text")
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].layer_input[:, :, 1] = 0
        inside = model.layers[1].attn_hyper_connection.input.save()
    assert (inside.unflatten(-1, (2, -1))[:, :, 1] == 0).all() and (inside.unflatten(-1, (2, -1))[:, :, 0] != 0).any()


def test_qwen4_exp_the_indexer_masks_the_keys_it_does_not_choose():
    needs("qwen4_exp_text")
    # a budget of 4 keys in blocks of 2: each query sees the 2 best blocks among its complete ones, plus its tail
    model = attnlens.StandardizedTransformer(
        tiny_model("qwen4_exp_text", indexer_budget=4), tokenizer=char_tokenizer(), attn_implementation="eager")
    assert failures(model, read_everything(model, "Hi"), 1) == []  # 2 tokens: the budget does not bind
    got = trace(model, lambda m: {"q": m.layers[1].self_attn.attention_queries,
                                  "k": m.layers[1].self_attn.attention_keys,
                                  "s": m.layers[1].self_attn.attention_scores,
                                  "p": m.layers[1].self_attn.attention_probabilities})
    seen = got["p"][0, 0] > 0
    assert (seen == (got["p"][0] > 0)).all()  # one choice for every head
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert not (seen & ~causal).any()
    counts = seen.sum(-1)
    # at most 2 blocks of 2 and a tail of 1; every visible key up to 5, fewer after
    assert counts.max() == 5 and (counts[:5] == torch.arange(1, 6)).all()
    assert (counts[5:] < torch.arange(6, N + 1)).all()
    hidden = got["s"][0, :, ~seen]
    future = got["s"][0, :, ~causal]
    assert ((hidden == torch.finfo(torch.float32).min) | (hidden == -torch.inf)).all()
    assert (future == (-torch.inf if sums_masks() else torch.finfo(torch.float32).min)).all()
    attn = model.layers[1].self_attn
    rebuilt = model.family.scores(attn.heads, model.config, got["q"], got["k"], 1)
    assert torch.allclose(rebuilt[0][:, seen], got["s"][0][:, seen], atol=1e-5)
    assert "indexer_budget=4" in model.support(1).notes["self_attn.attention_probabilities"]


def test_qwen4_exp_ple_layers_add_their_branch_before_the_hyper_connection():
    needs("qwen4_exp_text")
    # PLE on layer 0 (ple_layer_ids are 1-based and must be linear-attention layers)
    module = tiny_model("qwen4_exp_text", ple_layer_ids=[1], ple_embed_dim=32, ngram_vocab_size_base=1000,
                        split_ngram_parts=1)
    model = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer(), attn_implementation="eager")
    got = trace(model, lambda m: {"x": m.layers[0].layer_input, "a": m.layers[0].self_attn.attention_output,
                                  "m": m.layers[0].layer_mid})
    block = module.model.layers[0]
    with torch.no_grad():
        flat = got["x"].flatten(-2)
        flat = flat + block.ple(flat, ids(), None)
        _, streams, weights = block.attn_hyper_connection(flat)
        mid = streams + (got["a"].unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)
    assert torch.allclose(mid.unflatten(-1, (2, -1)), got["m"], atol=1e-5)
    # the family's identity (without the branch) does not hold there, and support() says why
    with torch.no_grad():
        plain = model.family.residual_add(block, "attention", got["x"], got["a"])
    assert not torch.allclose(plain, got["m"], atol=1e-3)
    assert "PLE" in model.support(0).notes["layer_mid"] and "PLE" not in model.support(1).notes["layer_mid"]


def test_qwen4_exp_composite_serves_its_language_model_as_the_text_model():
    needs("qwen4_exp")
    text, composite = tiny("qwen4_exp_text"), tiny("qwen4_exp")
    assert composite.family.layers == "model.language_model.layers"
    assert composite.support(1).notes["self_attn.attention_probabilities"] == text.support(1).notes[
        "self_attn.attention_probabilities"]
    assert "vision tower" in composite.support(0).notes["embeddings"]
    # the same text weights give the same values (a fresh composite: the session's tiny models stay unedited)
    module = tiny_model("qwen4_exp")
    inner = text._module.state_dict()
    module.model.language_model.load_state_dict({k.removeprefix("model."): v for k, v in inner.items()
                                                 if k.startswith("model.")})
    module.lm_head.load_state_dict(text._module.lm_head.state_dict())
    composite = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer(), attn_implementation="eager")
    a = trace(text, lambda m: {"p": m.layers[1].self_attn.attention_probabilities, "l": m.logits})
    b = trace(composite, lambda m: {"p": m.layers[1].self_attn.attention_probabilities, "l": m.logits})
    assert torch.allclose(a["p"], b["p"], atol=1e-6) and torch.allclose(a["l"], b["l"], atol=1e-5)


# --- Inkling -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1])
def test_inkling_scores_add_the_hidden_state_bias_within_its_extent(layer):
    model = tiny("inkling_text")
    attn = model.layers[layer].self_attn
    module = attn._module
    got = trace(model, lambda m: {"x": m.layers[layer].attention_norm_output,
                                  "q": m.layers[layer].self_attn.attention_queries,
                                  "k": m.layers[layer].self_attn.attention_keys,
                                  "s": m.layers[layer].self_attn.attention_scores})
    assert attn.scale == pytest.approx(1 / attn.head_dim)
    plain = model.family.scores(attn.heads, model.config, got["q"], got["k"], layer)
    bias = got["s"] - plain
    distance = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    extent = model.config.sliding_window_size if layer == 0 else model.config.rel_extent
    inside = (distance >= 0) & (distance < extent)
    assert (bias[..., ~inside] == 0).all() and (bias[..., inside].abs() > 1e-4).float().mean() > 0.9
    # by hand: per head, r_proj's weights mix the learned profiles, indexed by the distance back
    with torch.no_grad():
        weights = module.r_proj(got["x"]).view(1, N, attn.num_heads, -1)
        profiles = (weights @ module.rel_logits_proj.proj).transpose(1, 2)  # [batch, heads, query, extent]
    by_hand = profiles.gather(-1, distance.clamp(0, extent - 1).expand(1, attn.num_heads, N, N))
    assert torch.allclose(bias[..., inside], by_hand[..., inside], atol=1e-5)
    assert "relative-position bias" in model.support(layer).notes["self_attn.attention_scores"]


def test_inkling_keys_and_values_pass_their_short_convolutions():
    model = tiny("inkling_text")
    module = model.layers[1].self_attn._module
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "k": m.layers[1].self_attn.attention_keys,
                                  "v": m.layers[1].self_attn.attention_values})
    heads, size = module.num_key_value_heads, module.head_dim
    with torch.no_grad():
        keys = module.k_norm(module.k_sconv(module.k_proj(got["x"])).view(1, N, heads, size)).transpose(1, 2)
        values = module.v_sconv(module.v_proj(got["x"])).view(1, N, heads, size).transpose(1, 2)
        unconvolved = module.v_proj(got["x"]).view(1, N, heads, size).transpose(1, 2)
    assert torch.allclose(keys, got["k"], atol=1e-6) and torch.allclose(values, got["v"], atol=1e-6)
    assert not torch.allclose(unconvolved, got["v"], atol=1e-3)


def test_inkling_log_scaling_multiplies_the_full_layers_queries():
    model = tiny("inkling_text:log_scaling")
    module = model.layers[1].self_attn._module
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "q": m.layers[1].self_attn.attention_queries})
    floor, alpha = model.config.log_scaling_n_floor, model.config.log_scaling_alpha
    tau = 1 + alpha * torch.log(((torch.arange(N) + 1) / floor).clamp(min=1))
    with torch.no_grad():
        plain = module.q_norm(module.q_proj(got["x"]).view(1, N, -1, module.head_dim)).transpose(1, 2)
    assert torch.allclose(plain * tau[None, None, :, None], got["q"], atol=1e-6)
    assert tau[-1] > 1.5 and "tau" in model.support(1).notes["self_attn.attention_queries"]
    assert "tau" not in model.support(0).notes["self_attn.attention_queries"]  # sliding layers are not log-scaled


def test_inkling_dense_mlp_output_carries_its_global_scale():
    needs("inkling_text")
    module = tiny_model("inkling_text")
    with torch.no_grad():
        module.model.layers[0].mlp.global_scale.fill_(2.0)
    model = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer(), attn_implementation="eager")
    got = trace(model, lambda m: {"n": m.layers[0].mlp.mlp_neurons, "o": m.layers[0].mlp.mlp_output})
    with torch.no_grad():
        assert torch.allclose(module.model.layers[0].mlp.down_proj(got["n"]) * 2, got["o"], atol=1e-6)
    assert "global_scale" in model.support(0).notes["mlp.mlp_output"]
    assert "shared experts" in model.support(1)["mlp.mlp_activation"]


def test_inkling_patterns_are_not_rebuilt_or_summarised_from_queries_and_keys():
    needs("inkling_text")
    sdpa = attnlens.models.tiny("inkling_text", attn_implementation="sdpa", rebuild_patterns=True)
    reason = sdpa.support(0)["self_attn.attention_probabilities"]
    assert "rebuild_patterns cannot rebuild it here" in reason and "relative-position bias" in reason
    assert "score function is unavailable" in attnlens.heads.why_not(tiny("inkling_text"), 1)


# --- Inkling 2 ---------------------------------------------------------------------------------------------------


def test_inkling2_the_blocks_mlp_input_module_moves_aside_for_the_value():
    model = tiny("inkling2_text")
    layer = model.layers[1]
    assert type(layer.E_mlp_input._module).__name__ == "Inkling2BlockAttentionResidual"
    got = trace(model, lambda m: {"mid": m.layers[1].layer_mid, "mix": m.layers[1].E_mlp_input.output,
                                  "x": m.layers[1].mlp_input})
    with torch.no_grad():
        assert torch.allclose(layer._module.post_attention_layernorm(got["mix"][0]), got["x"], atol=1e-6)
    assert got["mid"].dtype == torch.float32


def test_inkling2_sinks_are_each_querys_own_logit():
    model = tiny("inkling2_text")
    module = model.layers[0].self_attn._module
    got = trace(model, lambda m: {"x": m.layers[0].attention_norm_output,
                                  "s": m.layers[0].self_attn.attention_scores,
                                  "z": m.layers[0].self_attn.attention_sinks,
                                  "p": m.layers[0].self_attn.attention_probabilities})
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
