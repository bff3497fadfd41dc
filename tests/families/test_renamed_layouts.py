"""Families whose blocks are the common arithmetic under other names, parts, norms or projections (issue 14, item 2):
what the shared identities can't see.

Each value is recomputed from the model's own modules (never from the location under test); the reasons, notes and
layer kinds the families state are pinned. Types the installed transformers lacks skip (conftest's `tiny`).
"""

import re

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for, trace

import attnlens
from attnlens.models import char_tokenizer


def merged(heads):
    return heads.reshape(*heads.shape[:2], -1)


# --- the score functions, with padding -------------------------------------------------------------------------------

#: Families whose score function is more than the common one (own masks, own order of mask and scale) or whose queries
#: and keys are read from an unusual place; each with a layer that has softmax attention.
SCORES = {"openai-gpt": 1, "codegen": 1, "dbrx": 1, "persimmon": 1, "ctrl": 1, "diffllama": 1, "granite_swa": 0,
          "laguna": 1, "jamba": 1, "recurrent_gemma": 1, "nemotron_h": 2, "falcon_h1": 1, "flint": 1, "beam": 1,
          "minimax": 0, "moshi": 1, "olmo_hybrid": 1, "modernbert-decoder": 0, "xglm": 1,
          "trocr": 1}


@pytest.mark.parametrize("case", SCORES)
def test_score_function_is_exact_with_padding(case):
    model, layer = tiny(case), SCORES[case]
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "Hi there"], return_tensors="pt", padding=True)
    assert not batch.attention_mask.all()

    def read(model):
        attn = model.layers[layer].self_attn
        return {"q": attn.attention_queries, "k": attn.attention_keys, "s": attn.attention_scores}

    got = trace(model, read, dict(batch))
    heads = model.layers[layer].self_attn.heads
    rebuilt = model.family.scores(heads, model.config, got["q"], got["k"], layer, key_mask=batch.attention_mask)
    real = batch.attention_mask.bool()[:, None, :, None]  # queries at padding positions see nothing real
    assert close(torch.where(real, rebuilt, 0), torch.where(real, got["s"], 0))


# --- OpenAI GPT: post-norm, its own mask, keys held transposed -------------------------------------------------------

def test_openai_gpt_masks_future_keys_with_minus_ten_thousand():
    scores = saved_for("openai-gpt")[(0, "attention_scores")]
    future = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).triu(1)
    assert (scores[..., future] == -1e4).all()
    assert "replaced by -10000" in tiny("openai-gpt").support(0).notes["self_attn.attention_scores"]


def test_openai_gpt_is_post_norm():
    model, saved = tiny("openai-gpt"), saved_for("openai-gpt")
    block = model.layers[1]._module
    mid, out = saved[(1, "layer_mid")], saved[(1, "layer_output")]
    with torch.no_grad():
        assert close(block.ln_1(mid), saved[(1, "mlp_input")])
        assert close(block.ln_2(block.ln_1(mid) + saved[(1, "mlp_output")]), out)
    report = model.support(1)
    assert report["attention_norm_output"].startswith("a post-norm block: attention reads the block input")
    assert model.support()["final_norm_output"].startswith("no final norm")


def test_openai_gpt_keys_are_a_view_of_the_split():
    model = tiny("openai-gpt")
    with torch.no_grad():
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_keys[:, 1] = 0  # head 1's keys, in place through the transposed view
            scores = model.layers[0].self_attn.attention_scores.save()
    visible = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    assert (scores[:, 1][..., visible] == 0).all() and not (scores[:, 0][..., visible] == 0).all()


# --- DiffLlama: two patterns subtracted per head pair ----------------------------------------------------------------

def test_diffllama_heads_mix_doubled_values_then_combine_in_pairs():
    model, saved = tiny("diffllama"), saved_for("diffllama")
    attn = model.layers[1].self_attn
    module = attn._module
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qk_head_dim) == (4, 2, 32, 16)
    with torch.no_grad():
        x = saved[(1, "attention_norm_output")]
        v = module.v_proj(x).view(1, len(PROMPT), 2, 16).transpose(1, 2)
        values = saved[(1, "attention_values")]
        # kv head g carries [v_(g mod kv/2) | v_(g mod kv/2 + kv/2)]
        assert close(values[:, 0], torch.cat([v[:, 0], v[:, 1]], -1)) and close(values[:, 1], values[:, 0])
        heads = saved[(1, "attention_head_outputs")]
        lam = (torch.exp((module.lambda_q1 * module.lambda_k1).sum()) - torch.exp((module.lambda_q2 * module.lambda_k2)
                                                                                  .sum()) + module.lambda_init)
        pair = heads[:, :, 0] - lam * heads[:, :, 2]  # head 0 with head 0 + num_heads / 2
        premix = saved[(1, "attention_premix")].view(1, len(PROMPT), 2, 32)
        assert close((1 - module.lambda_init) * module.groupnorm(pair), premix[:, :, 0])
    assert "differential head j" in model.support(1).notes["self_attn.attention_probabilities"]


@pytest.mark.parametrize("value", ["attention_values", "attention_probabilities"])
def test_diffllama_refuses_edits_that_would_reach_one_call(value):
    model = tiny("diffllama")
    with pytest.raises(attnlens.EditError):
        with torch.no_grad(), model.trace(PROMPT):
            attn = model.layers[0].self_attn
            setattr(attn, value, getattr(attn, value) * 0)


# --- BitNet: norms inside the attention and the MLP ------------------------------------------------------------------

def test_bitnet_premix_is_what_the_sub_norm_receives():
    model, saved = tiny("bitnet"), saved_for("bitnet")
    module = model.layers[0].self_attn._module
    with torch.no_grad():
        premix = saved[(0, "attention_premix")]
        assert close(premix, merged(saved[(0, "attention_head_outputs")]))
        assert close(module.o_proj(module.attn_sub_norm(premix)), saved[(0, "attention_output")])
        assert not close(module.o_proj(premix), saved[(0, "attention_output")], atol=1e-3)
    assert model.support(0)["mlp.mlp_activation"] is None  # the MLP's sub-norm: tests/families/test_mlp_arithmetic.py
    assert "ffn_sub_norm" in model.support(0).notes["mlp.mlp_neurons"]


# --- the mixer layers of hybrids -------------------------------------------------------------------------------------

#: case -> (a layer without softmax attention, the mixer's module name, words its reason says)
MIXERS = {
    "jamba": (0, "mamba", "a Mamba layer"),
    "bamba": (0, "mamba", "a Mamba-2 layer"),
    "lfm2": (0, "conv", "a short gated convolution"),
    "lfm2_moe": (2, "conv", "a short gated convolution"),
    "recurrent_gemma": (0, "temporal_block", "an RG-LRU recurrent block"),
}


@pytest.mark.parametrize("case", MIXERS)
def test_mixer_layers_serve_the_mixer_output_and_say_why_not_the_rest(case):
    model, (layer, mixer, words) = tiny(case), MIXERS[case]
    report = model.support(layer)
    for value in ("queries", "keys", "scores", "probabilities", "head_outputs", "premix"):
        reason = report[f"self_attn.attention_{value}"]
        assert f"layer {layer} of {model.family.name} is {words}" in reason and "not softmax attention" in reason
    assert report["self_attn.attention_output"] is None
    saved = saved_for(case)
    with torch.no_grad():
        out = getattr(model._module.get_submodule(model.family.layers)[layer], mixer)(
            saved[(layer, "attention_norm_output")], **({"position_ids": torch.arange(len(PROMPT))[None],
                                                          "attention_mask": None} if case == "recurrent_gemma" else {}))
    out = out[0] if isinstance(out, tuple) else out
    assert close(out, saved[(layer, "attention_output")])


def test_granite_hybrid_cannot_name_its_mamba_layers_self_attn():
    model = tiny("granitemoehybrid")
    reason = model.support(0)["self_attn.attention_output"]
    assert "keeps self_attn = None" in reason and "model.layers[0].mamba.output" in reason
    assert model.support(0)["mlp.mlp_output"].startswith("the MLP is the routed experts")
    assert model.support(1)["self_attn.attention_output"] is None


def test_falcon_h1_layer_mid_holds_the_mamba_branch():
    model, saved = tiny("falcon_h1"), saved_for("falcon_h1")
    config = model.config
    with torch.no_grad(), model.trace(PROMPT):
        mamba = model.layers[1].mamba.output.save()
    expected = (saved[(1, "layer_input")] + config.attention_out_multiplier * saved[(1, "attention_output")]
                + config.ssm_out_multiplier * mamba)
    assert close(expected, saved[(1, "layer_mid")])
    assert "times key_multiplier (0.5)" in model.support(1).notes["self_attn.attention_keys"]


def test_nemotron_h_blocks_serve_their_one_sublayer():
    model, saved = tiny("nemotron_h"), saved_for("nemotron_h")
    kinds = model.config.layers_block_type
    assert kinds == ["linear_attention", "moe", "full_attention", "mlp"]
    attention, mlp = model.support(2), model.support(3)
    assert attention["mlp.mlp_output"].startswith("layer 2 of Nemotron-H is an attention block: it has no MLP")
    assert mlp["self_attn.attention_output"].startswith("layer 3 of Nemotron-H is an MLP block: it has no attention")
    assert torch.equal(saved[(2, "layer_mid")], saved[(2, "layer_output")])
    assert torch.equal(saved[(3, "layer_mid")], saved[(3, "layer_input")])
    for layer, key in ((3, "self_attn.attention_output"), (2, "mlp.mlp_output")):  # no such module: still the reason
        sublayer, name = key.split(".")
        with pytest.raises(attnlens.Unavailable, match=re.escape(model.support(layer)[key])):
            getattr(getattr(model.layers[layer], sublayer), name)


def test_mllama_skips_cross_attention_blocks_on_text():
    model, saved = tiny("mllama"), saved_for("mllama")
    assert model.config.cross_attention_layers == [1]
    reason = model.support(1)["layer_input"]
    assert reason.startswith("layer 1 of Mllama is a cross-attention block")
    served = [key for key, reason in model.support(1).reasons.items() if reason is None]
    assert served == [] or set(served) <= {"embeddings", "final_norm_output", "logits"}  # the model's own values
    assert torch.equal(saved[(0, "layer_output")], saved[(2, "layer_input")])  # the stream passes the skipped block


# --- gates and sinks -------------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("case", ["afmoe", "laguna", "laguna:per_element_gate"])
def test_gates_are_recomputed_from_the_gate_projection(case):
    model, saved = tiny(case), saved_for(case)
    module = model.layers[1].self_attn._module
    x = saved[(1, "attention_norm_output")]
    with torch.no_grad():
        if case == "afmoe":
            expected = torch.sigmoid(module.gate_proj(x)).unflatten(-1, (-1, module.head_dim))
        else:
            gate = torch.nn.functional.softplus(module.g_proj(x))
            expected = gate[..., None].expand(-1, -1, -1, module.head_dim) if module.gate_per_head else \
                gate.unflatten(-1, (-1, module.head_dim))
    assert close(saved[(1, "attention_gate")], expected)
    if case.startswith("laguna"):
        assert model.layers[1].self_attn.num_heads == 8  # num_attention_heads_per_layer


# --- models around the blocks ----------------------------------------------------------------------------------------

def test_nanochat_final_norm_is_the_second_run():
    model, saved = tiny("nanochat"), saved_for("nanochat")
    inner = model._module
    with torch.no_grad():
        assert close(inner.model.norm(saved[(2, "layer_output")]), saved["final_norm_output"])
        assert close(inner.model.norm(saved["embeddings"]), saved[(0, "layer_input")])


def test_ctrl_embeddings_are_a_snapshot_before_the_in_place_scaling():
    model, saved = tiny("ctrl"), saved_for("ctrl")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(saved["embeddings"], model._module.transformer.w(ids))
    with pytest.raises(attnlens.EditError):
        with torch.no_grad(), model.trace(PROMPT):
            model.embeddings[:] = 0


def test_gpt_sw3_is_served_by_gpt2():
    from transformers import CONFIG_MAPPING

    assert CONFIG_MAPPING["gpt-sw3"]().model_type == "gpt2"
    assert isinstance(attnlens.registry.family_for("gpt-sw3"), type(attnlens.registry.family_for("gpt2")))


def test_cohere2_moe_rotates_only_sliding_and_prefix_layers():
    model = tiny("cohere2_moe")
    notes = [model.support(i).notes["self_attn.attention_queries"] for i in range(3)]
    assert notes[1].startswith("not rotated") and notes[0].startswith("rotated") and notes[2].startswith("rotated")
    assert model.support(1)["mlp.mlp_neurons"] is not None and model.support(0)["mlp.mlp_neurons"] is None


def test_granitemoeshared_mlp_output_is_the_sum_no_module_returns():
    model, saved = tiny("granitemoeshared"), saved_for("granitemoeshared")
    assert model.support(0)["mlp.mlp_output"].startswith("the MLP's output is block_sparse_moe's output plus")
    block = model.layers[0]._module
    with torch.no_grad():
        x = saved[(0, "mlp_input")]
        update = (block.block_sparse_moe(x) + block.shared_mlp(x)) * block.residual_multiplier
    assert close(saved[(0, "layer_mid")] + update, saved[(0, "layer_output")])


def test_moshi_prefill_is_full_causal_beyond_its_configured_window():
    model, saved = tiny("moshi"), saved_for("moshi")
    assert model.config.sliding_window == 4 < len(PROMPT)
    assert (saved[(0, "attention_probabilities")][0, :, -1] > 0).all()  # the last query sees all 18 keys
    assert "ignores config.sliding_window (4)" in model.support(0).notes["self_attn.attention_probabilities"]


def test_minimax_adds_attention_to_the_normalised_stream():
    model, saved = tiny("minimax"), saved_for("minimax")
    for layer in (0, 1):  # a softmax layer and a lightning layer
        block = model.layers[layer]._module
        with torch.no_grad():
            mid = block.input_layernorm(saved[(layer, "layer_input")]) * block.attn_alpha_factor + \
                saved[(layer, "attention_output")] * block.attn_beta_factor
        assert close(mid, saved[(layer, "layer_mid")])
        assert not close(saved[(layer, "layer_input")] + saved[(layer, "attention_output")], mid, atol=1e-2)
    assert "a lightning-attention layer" in model.support(1)["self_attn.attention_scores"]


def test_flint_sinks_are_the_dropped_softmax_column():
    model, saved = tiny("flint"), saved_for("flint")
    module = model.layers[1].self_attn._module
    scores = saved[(1, "attention_scores")]
    with_sink = torch.cat([scores, module.sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1).softmax(-1)
    assert close(saved[(1, "attention_sinks")], with_sink[..., -1])
    assert close(saved[(1, "attention_probabilities")], with_sink[..., :-1])


def test_olmo_hybrid_blocks_normalise_on_opposite_sides():
    model = tiny("olmo_hybrid")
    attention, linear = model.support(1), model.support(0)
    assert attention["attention_norm_output"].startswith("no norm in front of attention")
    assert linear["attention_norm_output"] is None and linear["mlp_norm_output"] is None
    assert "Gated DeltaNet" in linear["self_attn.attention_scores"]
    assert "post_attention_layernorm(attention_output)" in attention.notes["layer_mid"]


def test_lfm3_gate_is_one_sigmoid_per_head():
    model, saved = tiny("lfm3"), saved_for("lfm3")
    module = model.layers[1].self_attn._module
    with torch.no_grad():
        gate = torch.sigmoid(module.g_proj(saved[(1, "attention_norm_output")]))
    assert close(saved[(1, "attention_gate")], gate[..., None].expand(-1, -1, -1, module.head_dim))
    assert model.support(0)["self_attn.attention_gate"].startswith("layer 0 of Lfm3 is a short gated convolution")
