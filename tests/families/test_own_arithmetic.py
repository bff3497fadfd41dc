"""GPT-Neo, Bloom, MPT and Falcon (four layouts): families whose attention does its own arithmetic.

What the shared identities can't see: the score functions bit for bit (padding, decode steps, head counts that are
not a power of two), ALiBi slopes against transformers' own builders, the meanings these families give their values
(unscaled and twice-masked GPT-Neo scores, Falcon's ALiBi entering twice), edits through views and copies, Falcon's
orders per layout, the reasons `support()` gives, and sdpa.
"""

import math

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, failures, read_everything, saved_for, trace

import attnlens
from attnlens import family_for
from attnlens.models import char_tokenizer, tiny_model

CASES = ("gpt_neo", "bloom", "mpt", "falcon", "falcon:multihead", "falcon:new_architecture", "falcon:alibi")
ALIBI = ("bloom", "mpt", "falcon:alibi")
N = len(PROMPT)

_sdpa = {}


def falcon_sdpa(case):
    """Falcon under sdpa. Its attention class serves both, so transformers cannot switch it after loading
    (`set_attn_implementation` warns and keeps eager): set the config before wrapping, as loading would."""
    if case not in _sdpa:
        model = tiny_model(case)
        model.config._attn_implementation = "sdpa"
        _sdpa[case] = attnlens.StandardizedTransformer(model, tokenizer=char_tokenizer())
    return _sdpa[case]


def attention_reads(layer):
    def read(model):
        attn = model.layers[layer].self_attn
        return {"q": attn.attention_queries, "k": attn.attention_keys, "s": attn.attention_scores}
    return read


# --- the score functions, bit for bit ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_score_function_is_exact(case):
    model = tiny(case)
    saved = saved_for(case)
    for layer in range(model.num_layers):
        module = model.layers[layer].self_attn._module
        q, k = saved[(layer, "attention_queries")], saved[(layer, "attention_keys")]
        scores = model.family.scores(model.family.geometry(module), model.config, q, k, layer)
        assert torch.equal(scores, saved[(layer, "attention_scores")]), layer


@pytest.mark.parametrize("case", CASES)
def test_score_function_is_exact_with_left_padding(case):
    # ALiBi positions count real tokens only (Bloom, Falcon), padding keys are masked: the key mask must say so.
    model = tiny(case)
    tokenizer = char_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer([PROMPT, "Hi there"], return_tensors="pt", padding=True)
    assert not batch.attention_mask.all()
    layer = 1
    got = trace(model, attention_reads(layer), dict(batch))
    module = model.layers[layer].self_attn._module
    rebuilt = model.family.scores(model.family.geometry(module), model.config, got["q"], got["k"], layer,
                                    key_mask=batch.attention_mask)
    assert torch.equal(rebuilt, got["s"])


@pytest.mark.parametrize("case", CASES)
def test_score_function_is_exact_in_bfloat16(case):
    # dtypes differ per family: GPT-Neo upcasts, MPT's float32 bias and Falcon-ALiBi's upcast promote the scores,
    # masks take the model dtype's minimum
    model = attnlens.StandardizedTransformer(tiny_model(case).to(torch.bfloat16), tokenizer=char_tokenizer())
    got = trace(model, attention_reads(1))
    expected = torch.float32 if case in ("gpt_neo", "mpt", "falcon:alibi") else torch.bfloat16
    assert got["s"].dtype == expected
    heads = model.layers[1].self_attn.heads
    assert torch.equal(model.family.scores(heads, model.config, got["q"], got["k"], 1), got["s"])


@pytest.mark.parametrize("case", ALIBI)
def test_score_function_is_exact_with_six_heads(case):
    # 6 is not a power of two: Bloom/Falcon add odd powers of the next base, MPT interleaves its slopes.
    model = tiny(case, num_attention_heads=6, hidden_size=48)
    got = trace(model, attention_reads(0))
    assert got["q"].shape[1] == 6
    heads = model.layers[0].self_attn.heads
    assert torch.equal(model.family.scores(heads, model.config, got["q"], got["k"], 0), got["s"])


@pytest.mark.parametrize("heads", [*range(1, 41), 64, 71, 112])
def test_alibi_slopes_match_transformers(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    expected = bloom_alibi(mask, heads, torch.float32).view(2, heads, 1, 7)
    assert torch.equal(family_for("bloom").alibi(heads, 7, mask), expected)
    assert torch.equal(family_for("bloom").alibi(heads, 7), expected[:1])
    expected = falcon_alibi(mask, heads, torch.float32).view(2, heads, 1, 7)
    assert torch.equal(family_for("falcon").alibi(heads, 7, mask), expected)
    assert torch.equal(family_for("mpt").alibi(heads, 7), build_mpt_alibi_tensor(heads, 32)[:, :, -7:])


# --- what the scores mean ---------------------------------------------------------------------------------------------

def _visible(length):
    return torch.ones(length, length, dtype=torch.bool).tril()


@pytest.mark.parametrize("case", ALIBI)
def test_alibi_is_part_of_the_scores(case):
    """Scores minus the scaled q·k is the ALiBi bias, built here with transformers' own functions."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    model = tiny(case)
    layer = 1
    attn = model.layers[layer].self_attn
    saved = saved_for(case)
    q, k, s = (saved[(layer, name)] for name in ("attention_queries", "attention_keys", "attention_scores"))
    bias = (s - q @ k.transpose(-1, -2) * attn.scale)[..., _visible(N)]
    ones = torch.ones(1, N, dtype=torch.long)
    if case == "bloom":
        expected = bloom_alibi(ones, 4, torch.float32).view(4, 1, N)
    elif case == "mpt":
        expected = build_mpt_alibi_tensor(4, model.config.max_seq_len)[:, :, -N:]
    else:  # FalconModel folds alibi / sqrt(d) into the mask and the attention adds (alibi) / sqrt(d) again
        expected = 2 * falcon_alibi(ones, 4, torch.float32).view(4, 1, N) * attn.scale
    expected = expected.expand(4, N, N)[None][..., _visible(N)]
    assert close(bias, expected, atol=1e-4)
    assert expected.abs().max() > 1  # the bias binds on these lengths


def test_falcon_alibi_enters_twice_under_eager_once_under_sdpa():
    """Eager: (q·k + alibi) / sqrt(d) + the mask FalconModel built with alibi / sqrt(d) in it; sdpa adds only the
    mask."""
    eager, sdpa = tiny("falcon:alibi"), falcon_sdpa("falcon:alibi")
    layer = 1
    attn = sdpa.layers[layer].self_attn
    got = trace(sdpa, lambda m: {"q": attn.attention_queries, "k": attn.attention_keys, "v": attn.attention_values,
                                 "heads": attn.attention_head_outputs})
    module = attn._module
    # the family's (eager) score function
    double = eager.family.scores(eager.family.geometry(module), eager.config, got["q"], got["k"], layer)
    once = double - eager.family.alibi(4, N) * module.inv_norm_factor

    def mix(scores):
        return (scores.softmax(-1) @ got["v"]).transpose(1, 2)

    assert close(mix(once), got["heads"])
    assert not close(mix(double), got["heads"], atol=1e-3)
    assert "twice" in eager.support(layer).notes["self_attn.attention_scores"]


def test_gpt_neo_scores_are_unscaled_and_future_keys_masked_twice():
    model = tiny("gpt_neo")
    saved = saved_for("gpt_neo")
    assert [model.family.sliding_window(model.config, i) for i in range(3)] == [None, 4, None]
    assert model.layers[0].self_attn.scale == 1.0
    back = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    for layer in range(3):
        q, k, s = (saved[(layer, name)] for name in ("attention_queries", "attention_keys", "attention_scores"))
        seen = (back >= 0) & (back < (4 if layer == 1 else N))
        assert torch.equal(s[..., seen], (q @ k.transpose(-1, -2))[..., seen])  # no 1/sqrt(d)
        assert (s[..., back < 0] == -math.inf).all()  # the buffer's finfo.min plus the causal mask's
        assert (s[..., (back >= 0) & ~seen] == torch.finfo(torch.float32).min).all()
        assert ((back >= 0) & ~seen).any() == (layer == 1)
    assert "-inf" in model.support(1).notes["self_attn.attention_scores"]


def test_mpt_clip_qkv_clamps_queries_keys_and_values():
    model = attnlens.models.tiny("mpt", attn_config={"clip_qkv": 0.3})
    saved = read_everything(model, PROMPT)
    for name in ("attention_queries", "attention_keys", "attention_values"):
        assert saved[(1, name)].abs().max() == pytest.approx(0.3)  # binds
    assert all(failures(model, saved, layer) == [] for layer in range(model.num_layers))
    assert "clip_qkv" in model.support(1).notes["self_attn.attention_keys"]


# --- Bloom: the attention module and the MLP add the residual ------------------------------------------------------

def test_bloom_attention_output_is_the_projection_and_layer_mid_the_module_output():
    model = tiny("bloom")
    saved = saved_for("bloom")
    block = model.layers[1]._module
    v = {name: saved[(1, name)] for name in ("layer_input", "attention_premix", "attention_output", "layer_mid",
                                             "mlp_output", "layer_output")}
    with torch.no_grad():
        assert torch.equal(block.self_attention.dense(v["attention_premix"]), v["attention_output"])
    assert torch.equal(v["layer_input"] + v["attention_output"], v["layer_mid"])  # dropout_add, in eval
    assert torch.equal(v["layer_mid"] + v["mlp_output"], v["layer_output"])
    assert not close(v["attention_output"], v["layer_mid"])
    notes = model.support(1).notes
    assert "residual + this" in notes["self_attn.attention_output"] and "residual + this" in notes["mlp.mlp_output"]


def test_bloom_residual_after_the_norm():
    """apply_residual_connection_post_layernorm: the block adds to the norms' outputs; the notes say so."""
    model = tiny("bloom:post_norm_residual")
    saved = read_everything(model, PROMPT)
    v = {name: saved[(1, name)] for name in ("layer_input", "attention_norm_output", "attention_output", "layer_mid",
                                             "mlp_norm_output", "mlp_output", "layer_output")}
    assert torch.equal(v["attention_norm_output"] + v["attention_output"], v["layer_mid"])
    assert torch.equal(v["mlp_norm_output"] + v["mlp_output"], v["layer_output"])
    assert not close(v["layer_input"] + v["attention_output"], v["layer_mid"])
    notes = model.support(1).notes
    assert notes["layer_mid"].startswith("apply_residual_connection_post_layernorm: attention_norm_output + ")
    assert notes["layer_output"].startswith("apply_residual_connection_post_layernorm: mlp_norm_output + ")
    assert "layer_mid" not in tiny("bloom").support(1).notes


def test_bloom_sliced_tensor_parallel_projections_are_unavailable():
    model = tiny("bloom", pretraining_tp=2, slow_but_exact=True)
    report = model.support(1)
    why = ("config.pretraining_tp=2 with slow_but_exact=True runs the {} as sliced F.linear calls, so `{}` is never "
           "called; load with slow_but_exact=False")
    for key in ("self_attn.attention_premix", "self_attn.attention_output"):
        assert report[key] == why.format("output projection", "dense")
    for key in ("mlp.mlp_neurons", "mlp.mlp_output"):
        assert report[key] == why.format("MLP's down projection", "dense_4h_to_h")
    with pytest.raises(attnlens.Unavailable, match=r"sliced F\.linear"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].self_attn.attention_premix.save()
    assert report["self_attn.attention_head_outputs"] is None


def test_bloom_head_output_edit_moves_the_logits_as_recomputed_by_hand():
    """Head outputs are a view of the bmm's [batch*heads] mix: an in-place edit lands; recompute the last block."""
    model = tiny("bloom")
    last = model.num_layers - 1
    layer = model.layers[last]
    with torch.no_grad(), model.trace(PROMPT):
        layer_input = layer.layer_input.save()
        layer.self_attn.attention_head_outputs[:, :, 1] = 0
        premix = layer.self_attn.attention_premix.save()
        logits = model.logits.save()
    inner, block = model._module, layer._module
    assert (premix[..., 16:32] == 0).all() and (premix[..., :16] != 0).all()
    with torch.no_grad():
        mid = layer_input + block.self_attention.dense(premix)
        out = block.mlp(block.post_attention_layernorm(mid), mid)
        by_hand = inner.lm_head(inner.transformer.ln_f(out))
    assert close(logits, by_hand) and not close(logits, saved_for("bloom")["logits"])


# --- edits through views and copies -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["gpt_neo", "bloom", "falcon:alibi"])
def test_head_outputs_view_takes_in_place_edits_and_assignment(case):
    model = tiny(case)
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_head_outputs[:, :, 2] = 0
        in_place = attn.attention_premix.save()
    with torch.no_grad(), model.trace(PROMPT):
        heads = attn.attention_head_outputs
        attn.attention_head_outputs = heads * 0 + 1.5
        assigned = attn.attention_premix.save()
    assert (in_place[..., 32:48] == 0).all() and (in_place[..., 48:] != 0).all()
    assert (assigned == 1.5).all()


@pytest.mark.parametrize("case", ["bloom", "mpt", "gpt_neo"])
def test_key_edits_land_in_the_scores(case):
    """Keys are (views of) what the arithmetic uses: Bloom's [batch*heads] keys, MPT's transposed ones, `_attn`'s."""
    model = tiny(case)
    layer = 1
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        q = attn.attention_queries.save()
        keys = attn.attention_keys
        keys[:, 0] *= 0
        keys = keys.save()
        scores = attn.attention_scores.save()
    assert (keys[:, 0] == 0).all()
    module = attn._module
    assert torch.equal(model.family.scores(model.family.geometry(module), model.config, q, keys, layer), scores)
    assert not torch.equal(scores, saved_for(case)[(layer, "attention_scores")])


def test_falcon_new_architecture_keys_are_a_deduplicated_copy():
    model = tiny("falcon:new_architecture")
    layer = 1
    attn = model.layers[layer].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    with torch.no_grad(), model.trace(PROMPT):
        keys = attn.attention_keys.save()
        held = attn.source.layer_past_update_0.output[0].save()  # what the forward holds: broadcast to 4 heads
    assert keys.shape == (1, 2, N, 16) and held.shape == (1, 4, N, 16)
    assert torch.equal(held[:, 0], held[:, 1]) and torch.equal(held[:, 2], held[:, 3])
    assert torch.equal(keys, held[:, ::2])
    # assignment is re-broadcast to both heads of each group
    with torch.no_grad(), model.trace(PROMPT):
        q = attn.attention_queries.save()
        attn.attention_keys = attn.attention_keys * 2
        values = attn.attention_values
        attn.attention_values = values * 0 + 0.5
        scores = attn.attention_scores.save()
        heads = attn.attention_head_outputs.save()
    assert torch.equal(model.family.scores(attn.heads, model.config, q, keys * 2, layer), scores)
    assert close(heads, torch.full_like(heads, 0.5))
    # an in-place edit of the copy could not land: it is refused, naming the value and what to do
    with pytest.raises(attnlens.EditError, match=r"layers\[1\].self_attn.attention_keys was edited in place.*Assign"):
        with torch.no_grad(), model.trace(PROMPT):
            attn.attention_keys.mul_(0)
            attn.attention_scores.save()
    note = model.support(layer).notes["self_attn.attention_keys"]
    assert note.startswith("a de-duplicated copy: _split_heads broadcasts each key/value head to its group")
    assert "in-place edits do not land" in note


def test_falcon_new_architecture_value_edit_moves_the_logits_as_recomputed_by_hand():
    model = tiny("falcon:new_architecture")
    last = model.num_layers - 1
    layer = model.layers[last]
    with torch.no_grad(), model.trace(PROMPT):
        layer_input = layer.layer_input.save()
        mlp_norm = layer.mlp_norm_output.save()
        values = layer.self_attn.attention_values
        values[:, 1] = 0  # on the copy; the assignment below is what lands
        layer.self_attn.attention_values = values
        probs = layer.self_attn.attention_probabilities.save()
        logits = model.logits.save()
        values = values.save()
    inner, block = model._module, layer._module
    with torch.no_grad():
        heads = probs @ values.repeat_interleave(2, dim=1)
        attention = block.self_attention.dense(heads.transpose(1, 2).reshape(1, N, 64))
        out = layer_input + attention + block.mlp(mlp_norm)
        by_hand = inner.lm_head(inner.transformer.ln_f(out))
    assert close(logits, by_hand) and not close(logits, saved_for("falcon:new_architecture")["logits"])


def test_falcon_parallel_mlp_output_is_a_snapshot_before_the_in_place_add():
    model = tiny("falcon")
    saved = saved_for("falcon")
    layer = model.layers[1]
    mlp_output, attention = saved[(1, "mlp_output")], saved[(1, "attention_output")]
    with torch.no_grad():
        assert torch.equal(layer._module.mlp(saved[(1, "mlp_input")]), mlp_output)  # not mlp + attention
    with torch.no_grad(), model.trace(PROMPT):
        layer_input = layer.layer_input.save()
        attention = layer.self_attn.attention_output.save()
        layer.mlp.mlp_output = torch.zeros_like(layer.mlp.mlp_output)
        layer_output = layer.layer_output.save()
    assert torch.equal(layer_output, layer_input + attention)
    assert model.support(1).notes["mlp.mlp_output"].startswith("a snapshot (copy) of the MLP's output")


# --- Falcon: orders and reasons per layout --------------------------------------------------------------------------

ATTENTION_ORDER = ["self_attn.attention_queries", "self_attn.attention_keys", "self_attn.attention_scores",
                   "self_attn.attention_probabilities", "self_attn.attention_head_outputs",
                   "self_attn.attention_premix", "self_attn.attention_output"]
MLP_ORDER = ["mlp.mlp_activation", "mlp.mlp_neurons", "mlp.mlp_output", "layer_output"]
FALCON_ORDERS = {
    # one shared norm: the MLP's norm output is read as the MLP receives it
    "falcon": ["layer_input", "attention_norm_output", *ATTENTION_ORDER, "mlp_norm_output", *MLP_ORDER],
    "falcon:multihead": ["layer_input", "attention_norm_output", *ATTENTION_ORDER, "layer_mid", "mlp_norm_output",
                         "mlp_input", *MLP_ORDER],
    # ln_mlp runs before attention
    "falcon:new_architecture": ["layer_input", "attention_norm_output", "mlp_norm_output", *ATTENTION_ORDER,
                                "mlp_input", *MLP_ORDER],
    "falcon:alibi": ["layer_input", "attention_norm_output", *ATTENTION_ORDER, "layer_mid", "mlp_norm_output",
                     "mlp_input", *MLP_ORDER],
}


@pytest.mark.parametrize("case", list(FALCON_ORDERS))
def test_falcon_order_per_layout(case):
    model = tiny(case)
    order = model.order(1)
    distinct = sorted(set(order.values()))
    firsts = [next(key for key, rank in order.items() if rank == r) for r in distinct]
    assert firsts == FALCON_ORDERS[case]
    assert order["self_attn.attention_values"] == order["self_attn.attention_keys"]  # both from the cache update
    shared = case in ("falcon",)
    assert (order["mlp_norm_output"] == order["mlp_input"]) == shared


def test_falcon_rotary_and_alibi_bind_different_operations():
    rotary, alibi = tiny("falcon:multihead"), tiny("falcon:alibi")

    def path(model, name):
        location = model.family.location(name, model.config, 1)
        return getattr(location, "source", location).path

    assert path(rotary, "attention_queries") == ("apply_rotary_pos_emb_0",)
    assert path(alibi, "attention_queries") == ("query_layer_0",)
    assert path(rotary, "attention_scores") == ("F_softmax_0",)
    assert path(alibi, "attention_scores") == ("F_softmax_1",)
    assert path(rotary, "attention_probabilities") == ("attention_scores_2",)  # no dropout on the rotary branch
    assert path(alibi, "attention_probabilities") == ("attention_probs_2",)


def test_falcon_new_architecture_reads_the_mlp_norm_before_attention():
    model = tiny("falcon:new_architecture")
    layer = model.layers[1]
    with torch.no_grad(), model.trace(PROMPT):
        norm = layer.mlp_norm_output.save()
        queries = layer.self_attn.attention_queries.save()
    assert norm.shape == (1, N, 64) and queries.shape == (1, 4, N, 16)
    with pytest.raises(attnlens.OrderError, match=r"layers\[1\].mlp_norm_output was read after "
                                                  r"layers\[1\].self_attn.attention_queries"):
        with torch.no_grad(), model.trace(PROMPT):
            layer.self_attn.attention_queries.save()
            layer.mlp_norm_output.save()
    sequential = tiny("falcon:alibi")  # the same reads are in order on a sequential block
    with torch.no_grad(), sequential.trace(PROMPT):
        sequential.layers[1].self_attn.attention_queries.save()
        sequential.layers[1].mlp_norm_output.save()


def test_falcon_alibi_out_of_order_read_raises():
    model = tiny("falcon:alibi")
    attn = model.layers[1].self_attn
    with pytest.raises(attnlens.OrderError, match="attention_scores was read after"):
        with torch.no_grad(), model.trace(PROMPT):
            attn.attention_probabilities.save()
            attn.attention_scores.save()


@pytest.mark.parametrize("case", ["falcon", "falcon:new_architecture"])
def test_falcon_parallel_block_has_no_layer_mid(case):
    model = tiny(case)
    reason = model.support(1)["layer_mid"]
    norms = "one shared input_layernorm" if case == "falcon" else "ln_attn and ln_mlp respectively"
    assert reason == ("a parallel block: attention and the MLP both read the block input (through " + norms +
                      ") and the block adds both outputs to it at once, so no residual stream exists between "
                      "attention and the MLP; layer_input + attention_output + mlp_output == layer_output")
    with pytest.raises(attnlens.Unavailable, match="a parallel block"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].layer_mid.save()


def test_falcon_keys_need_the_cache():
    model = tiny("falcon", use_cache=False)
    reason = model.support(1)["self_attn.attention_values"]
    assert reason == ("read at the cache update, which config.use_cache=False skips; load with use_cache=True "
                      "(the default)")
    with pytest.raises(attnlens.Unavailable, match=r"config\.use_cache=False"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].self_attn.attention_keys.save()


@pytest.mark.parametrize("case", ["falcon", "falcon:new_architecture", "falcon:alibi"])
def test_falcon_sdpa_serves_all_but_scores_and_pattern(case):
    sdpa = falcon_sdpa(case)
    assert sdpa.config._attn_implementation == "sdpa"
    report = sdpa.support(1)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert report[key].startswith("read inside transformers' eager attention function, but this model runs "
                                      "'sdpa'")
    with pytest.raises(attnlens.Unavailable, match="'sdpa'"):
        with torch.no_grad(), sdpa.trace(PROMPT):
            sdpa.layers[1].self_attn.attention_scores.save()
    names = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs",
             "attention_premix", "attention_output")
    layer = 1
    if case == "falcon:alibi":  # eager doubles ALiBi, sdpa doesn't: the mix differs from layer 0 on (tested above)
        names, layer = names[:3], 0
    got = trace(sdpa, lambda m: {name: getattr(m.layers[layer].self_attn, name) for name in names})
    eager = saved_for(case)
    for name in names:
        assert close(got[name], eager[(layer, name)], atol=1e-5), name


# --- generation: decode steps against the whole cache ---------------------------------------------------------------

@pytest.mark.parametrize(("case", "options"), [(case, {}) for case in CASES] + [("mpt", {"use_cache": True})])
def test_decode_steps_see_the_whole_cache(case, options):
    # MptConfig defaults to use_cache=False: each step then recomputes every position
    model = tiny(case, **options)
    layer = 1
    attn = model.layers[layer].self_attn
    names = ("attention_queries", "attention_keys", "attention_values", "attention_scores",
             "attention_probabilities", "attention_head_outputs")
    order = model.order(layer)
    in_order = sorted(names, key=lambda name: order[f"self_attn.{name}"])  # MPT reads its values after the pattern
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as tracer:
        steps = list().save()
        for _ in tracer.iter[:2]:
            read = {name: getattr(attn, name) for name in in_order}
            steps.append(tuple(read[name] for name in names))
    groups = attn.num_heads // attn.num_kv_heads
    for step, (q, k, v, scores, probs, heads) in enumerate(steps):
        rows = 1 if step and model.config.use_cache else N + step
        assert q.shape[2] == rows and k.shape[2] == v.shape[2] == N + step and probs.shape[2:] == (rows, N + step)
        assert torch.equal(model.family.scores(attn.heads, model.config, q, k, layer), scores)
        assert close((probs @ v.repeat_interleave(groups, dim=1)).transpose(1, 2), heads)
    # the step's keys extend the prefill's (recomputed without a cache: equal up to rounding)
    assert close(steps[1][1][:, :, :N], steps[0][1])


# --- attention classes attnlens does not read -------------------------------------------------------------------------

@pytest.mark.parametrize(("case", "reads"), [("gpt_neo", "read in GPTNeoSelfAttention._attn, which the "
                                                     "'flash_attention_2' attention never calls"),
                                         ("falcon", "the 'flash_attention_2' attention is FalconFlashAttention2, "
                                                    "whose own forward attnlens does not read")])
def test_flash_attention_is_reported_not_misread(case, reads):
    # flash-attn needs a GPU: the reasons are computed from the config alone, before anything runs
    model = tiny_model(case)
    model.config._attn_implementation = "flash_attention_2"
    reasons = family_for(case).unavailable(model.config, 1)
    for name in ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs"):
        assert reasons[name].startswith(reads), name
    assert "attention_premix" not in reasons and "attention_output" not in reasons
