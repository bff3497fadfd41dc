"""GPT-BigCode, GPT-J, GPT-NeoX, Phi, Phi-3, OPT, Cohere and StableLM: what the shared identities can't see.

Values are recomputed from the model's own modules (never from the location under test); reasons, orders and notes
the families state are pinned.
"""

import sys

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, read_everything, saved_for, visible

import attnlens
from attnlens.models import char_tokenizer, tiny_model

FAMILIES = ("gpt_bigcode", "gptj", "gpt_neox", "phi", "phi3", "opt", "cohere", "stablelm")
#: Parallel blocks where attention and the MLP read one norm output -> that norm.
SHARED_NORM = {"gptj": "ln_1", "phi": "input_layernorm", "phi:qk_layernorm": "input_layernorm",
               "cohere": "input_layernorm", "cohere:qk_norm": "input_layernorm", "stablelm:parallel": "input_layernorm"}
PARALLEL = (*SHARED_NORM, "gpt_neox")
LAYER = 1

def at(case, name, layer=LAYER):
    return saved_for(case)[(layer, name)]


def heads(x, head_dim):
    """[b, s, n * d] -> [b, n, s, d]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def attention_module(case, layer=LAYER):
    return tiny(case).layers[layer].self_attn._module


# --- parallel blocks -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", PARALLEL)
def test_parallel_block_has_no_layer_mid(case):
    model = tiny(case)
    reason = model.support(LAYER)["layer_mid"]
    assert reason.startswith("a parallel block: attention and the MLP both read the block input")
    assert "no residual stream exists between attention and the MLP" in reason
    with pytest.raises(attnlens.Unavailable, match="a parallel block"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[LAYER].layer_mid.save()


@pytest.mark.parametrize("case", list(SHARED_NORM))
def test_shared_norm_is_the_mlp_norm_output(case):
    """mlp_norm_output is the one norm output both sublayers read, served where the MLP reads it (after attention)."""
    model = tiny(case)
    block = model.layers[LAYER]._module
    norm_output = at(case, "mlp_norm_output")
    assert torch.equal(norm_output, at(case, "attention_norm_output"))
    assert close(getattr(block, SHARED_NORM[case])(at(case, "layer_input")), norm_output)
    order = model.order(LAYER)
    assert order["mlp_norm_output"] == order["mlp_input"] > order["self_attn.attention_output"]
    assert model.support(LAYER).notes["mlp_norm_output"].startswith(
        f"a parallel block: attention and the MLP read the same {SHARED_NORM[case]} output")


@pytest.mark.parametrize("case", ["gptj", "phi", "cohere", "stablelm:parallel"])
def test_assigning_the_shared_norm_output_changes_only_the_mlp(case):
    model = tiny(case)
    layer = model.layers[LAYER]
    with torch.no_grad(), model.trace(PROMPT):
        layer_input = layer.layer_input.save()
        attention = layer.self_attn.attention_output.save()
        layer.mlp_norm_output = torch.zeros_like(layer.mlp_norm_output)
        mlp = layer.mlp.mlp_output.save()
        out = layer.layer_output.save()
    family, block = model.family, layer._module
    assert torch.equal(attention, at(case, "attention_output"))  # attention read the norm output before the edit
    with torch.no_grad():
        expected = family.mlp_forward(family.mlp_module(block), torch.zeros_like(layer_input))
    assert close(mlp, expected) and not close(mlp, at(case, "mlp_output"))
    assert close(out, layer_input + attention + mlp)


def test_gpt_neox_parallel_mlp_norm_reads_the_block_input():
    # Fresh LayerNorms are the identity's affine (weight 1, bias 0), which would make the two norms indistinguishable.
    inner = tiny_model("gpt_neox", seed=1)
    with torch.no_grad():
        for norm in (m for m in inner.modules() if isinstance(m, torch.nn.LayerNorm)):
            norm.weight.normal_(1, 0.5), norm.bias.normal_(0, 0.5)
    model = attnlens.StandardizedTransformer(inner, tokenizer=char_tokenizer())
    saved = read_everything(model, PROMPT)
    block = inner.gpt_neox.layers[LAYER]
    norm_output = saved[(LAYER, "mlp_norm_output")]
    with torch.no_grad():
        assert close(block.post_attention_layernorm(saved[(LAYER, "layer_input")]), norm_output)
    assert not close(norm_output, saved[(LAYER, "attention_norm_output")])
    sequential = tiny("gpt_neox:sequential").layers[LAYER]._module
    assert close(sequential.post_attention_layernorm(at("gpt_neox:sequential", "layer_mid")),
                 at("gpt_neox:sequential", "mlp_norm_output"))


def test_order_with_and_without_the_parallel_residual():
    head = ["layer_input", "attention_norm_output", "self_attn.attention_queries", "self_attn.attention_keys",
            "self_attn.attention_key_positions", "self_attn.attention_values", "self_attn.attention_scores",
            "self_attn.attention_probabilities",
            "self_attn.attention_head_outputs", "self_attn.attention_premix", "self_attn.attention_output"]
    tail = ["mlp_input", "mlp.mlp_activation", "mlp.mlp_neurons", "mlp.mlp_output", "layer_output"]
    assert list(tiny("stablelm").order(LAYER)) == [*head, "layer_mid", "mlp_norm_output", *tail]
    parallel = tiny("stablelm:parallel").order(LAYER)
    assert list(parallel) == [*head, "mlp_norm_output", *tail]
    assert parallel["mlp_norm_output"] == parallel["mlp_input"]
    assert "layer_mid" not in parallel


def test_reading_the_mlp_norm_output_before_attention_output_raises():
    model = tiny("phi")
    layer = model.layers[LAYER]
    with pytest.raises(attnlens.OrderError, match="attention_output"):
        with torch.no_grad(), model.trace(PROMPT):
            layer.mlp_norm_output.save()
            layer.self_attn.attention_output.save()


# --- rotary embeddings: partial, interleaved -------------------------------------------------------------------------

def projected_queries(case, layer=LAYER):
    """The per-head query projection of the attention norm output, QK-norm applied where the family has one."""
    module = attention_module(case, layer)
    x = at(case, "attention_norm_output", layer)
    if hasattr(module, "query_key_value"):  # GPT-NeoX: per head [q|k|v]
        d = module.head_size
        return module.query_key_value(x).view(*x.shape[:2], -1, 3 * d).transpose(1, 2)[..., :d]
    q = heads(module.q_proj(x), module.head_dim)
    norm = getattr(module, "q_layernorm", None) or getattr(module, "q_norm", None)
    if norm is not None:
        q = norm(q) if not hasattr(module, "use_qk_norm") else norm(q.transpose(1, 2)).transpose(1, 2)
    return q


ROTARY = {"gptj": 8, "gpt_neox": 4, "phi": 8, "phi:qk_layernorm": 8, "stablelm": 4, "stablelm:qk_layernorm": 4}


@pytest.mark.parametrize("case", list(ROTARY))
def test_partial_rotary_leaves_the_tail_of_each_head_unrotated(case):
    module = attention_module(case)
    rotary = getattr(module, "rotary_dim", None) or module.rotary_ndims
    assert rotary == ROTARY[case]
    with torch.no_grad():
        q = projected_queries(case)
    queries = at(case, "attention_queries")
    assert close(queries[..., rotary:], q[..., rotary:])
    assert not close(queries[..., 1:, :rotary], q[..., 1:, :rotary])  # position 0 is not rotated


@pytest.mark.parametrize("case", ["gptj", "cohere", "cohere:qk_norm"])
def test_interleaved_rotary_rotates_adjacent_pairs(case):
    """Rotating pairs (0, 1), (2, 3), ... keeps each adjacent pair's length; rotate-half would not."""
    module = attention_module(case)
    rotary = getattr(module, "rotary_dim", None) or module.head_dim
    with torch.no_grad():
        q = projected_queries(case)[..., :rotary]
    queries = at(case, "attention_queries")[..., :rotary]

    def pair_lengths(x):
        return x.unflatten(-1, (-1, 2)).norm(dim=-1)

    assert close(pair_lengths(queries), pair_lengths(q), atol=1e-4)
    assert not close(queries, q)


# --- fused projections ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["gpt_bigcode", "gpt_bigcode:multi_head"])
def test_gpt_bigcode_split(case):
    model = tiny(case)
    module = attention_module(case)
    h, d = module.num_heads, module.head_dim
    with torch.no_grad():
        fused = module.c_attn(at(case, "attention_norm_output"))
    if model.config.multi_query:  # [q (all heads) | k (one head) | v (one head)]
        q, k, v = heads(fused[..., :h * d], d), fused[..., None, h * d:h * d + d], fused[..., None, h * d + d:]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        assert model.layers[LAYER].self_attn.num_kv_heads == 1
    else:  # per head [q|k|v]
        q, k, v = fused.view(*fused.shape[:2], h, 3 * d).transpose(1, 2).split(d, dim=-1)
    assert torch.equal(at(case, "attention_queries"), q)
    assert torch.equal(at(case, "attention_keys"), k) and torch.equal(at(case, "attention_values"), v)


def test_gpt_bigcode_multi_query_keys_edit_in_place_for_every_head():
    model = tiny("gpt_bigcode")
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_keys[:] = 0  # the one shared key head
        probs = attn.attention_probabilities.save()
    n = probs.shape[-1]
    uniform = visible(model.config, model.family, LAYER, n) / torch.arange(1, n + 1)[:, None]
    assert close(probs[0], uniform.expand_as(probs[0]))
    with pytest.raises(attnlens.EditError, match="Assign it instead"):
        with model.trace(PROMPT):
            attn.attention_queries[:] = 0


@pytest.mark.parametrize("case", ["gpt_neox", "gpt_neox:sequential"])
def test_gpt_neox_per_head_fused_split(case):
    module = attention_module(case)
    d = module.head_size
    with torch.no_grad():
        x = at(case, "attention_norm_output")
        q, k, v = module.query_key_value(x).view(*x.shape[:2], -1, 3 * d).transpose(1, 2).chunk(3, dim=-1)
    r = module.rotary_ndims
    assert torch.equal(at(case, "attention_values"), v)
    assert close(at(case, "attention_keys")[..., r:], k[..., r:])
    assert close(at(case, "attention_queries")[..., r:], q[..., r:])


def test_phi3_fused_qkv_and_gate_up():
    model = tiny("phi3")
    module = attention_module("phi3")
    h, kv, d = model.config.num_attention_heads, model.config.num_key_value_heads, module.head_dim
    with torch.no_grad():
        fused = module.qkv_proj(at("phi3", "attention_norm_output"))
        q, k, v = (heads(part, d) for part in fused.split([h * d, kv * d, kv * d], dim=-1))
        cos, sin = model._module.model.rotary_emb(q, torch.arange(q.shape[2])[None])
        q, k = sys.modules[type(module).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(at("phi3", "attention_values"), v)
    assert close(at("phi3", "attention_queries"), q) and close(at("phi3", "attention_keys"), k)
    mlp = model.layers[LAYER].mlp._module
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(at("phi3", "mlp_input")).chunk(2, dim=-1)
    activation = at("phi3", "mlp_activation")
    assert close(activation, mlp.activation_fn(gate))
    assert close(at("phi3", "mlp_neurons"), up * activation)


# --- OPT: pre-scaled queries, an MLP on flattened tokens -------------------------------------------------------------

def test_opt_queries_are_pre_scaled_and_scores_unscaled():
    model = tiny("opt")
    attn = model.layers[LAYER].self_attn
    module = attn._module
    assert attn.scale == 1.0
    with torch.no_grad():
        q = heads(module.q_proj(at("opt", "attention_norm_output")) * module.head_dim ** -0.5, module.head_dim)
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
            assert close(model.family.mlp_forward(block, x), out)


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


# --- GPT-J: float32 scores; 5.19's own _attn ------------------------------------------------------------------------

def test_gptj_scores_are_float32_in_a_bfloat16_model():
    model = attnlens.StandardizedTransformer(tiny_model("gptj").to(torch.bfloat16), tokenizer=char_tokenizer())
    attn = model.layers[LAYER].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        q, k = attn.attention_queries.save(), attn.attention_keys.save()
        scores, probs = attn.attention_scores.save(), attn.attention_probabilities.save()
    assert q.dtype == torch.bfloat16 and scores.dtype == torch.float32 and probs.dtype == torch.bfloat16
    assert torch.equal(model.family.scores(attn.heads, model.config, q, k, LAYER), scores)
    masked = ~visible(model.config, model.family, LAYER, q.shape[2])
    assert (scores[..., masked] < torch.finfo(torch.bfloat16).min / 2).all()
    assert "float32" in model.support(LAYER).notes["self_attn.attention_scores"]


def test_gptj_head_output_edits_land_in_place():
    """On transformers 5.19 the head outputs are a transposed view of `_attn`'s output; in-place edits still land."""
    model = tiny("gptj")
    attn = model.layers[LAYER].self_attn
    d = attn.head_dim
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_head_outputs[:, :, 0] = 0
        premix = attn.attention_premix.save()
    assert (premix[..., :d] == 0).all() and torch.equal(premix[..., d:], at("gptj", "attention_premix")[..., d:])


# --- Cohere: the logit scale ---------------------------------------------------------------------------------------

def test_cohere_logits_are_scaled():
    model = tiny("cohere")
    scale = model.config.logit_scale
    assert scale != 1
    with torch.no_grad():
        expected = model._module.lm_head(saved_for("cohere")["final_norm_output"]) * scale
    assert close(saved_for("cohere")["logits"], expected)
    assert str(scale) in model.support(0).notes["logits"]


# --- every family: sdpa ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", FAMILIES)
def test_sdpa_serves_all_but_scores_and_pattern(case):
    try:
        sdpa = tiny(case, attn_implementation="sdpa")
    except ValueError as error:  # "does not support an attention implementation through ... sdpa"
        pytest.skip(f"{case} has no sdpa path on this transformers (GPT-J before 5.20 runs its own _attn): {error}")
    report = sdpa.support(LAYER)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert "attn_implementation='eager'" in report[key]
    names = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs", "attention_premix",
             "attention_output")
    got = []
    with torch.no_grad(), sdpa.trace(PROMPT):
        attn = sdpa.layers[LAYER].self_attn
        got += [getattr(attn, name).save() for name in names] + [sdpa.layers[LAYER].mlp.mlp_output.save()]
    for name, b in zip((*names, "mlp_output"), got):  # sdpa rounds differently: tolerance relative to the magnitudes
        a = at(case, name)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max()), name
