"""Falcon (attnlens/families/falcon.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import N, close, saved_for, trace

import attnlens
from attnlens.families.falcon import own_arithmetic
from attnlens.models import char_tokenizer, tiny_model

#: transformers 5.24 runs Falcon's own arithmetic, 5.25 the shared attention interface (the family's docstring).
OWN = own_arithmetic()
own_only = pytest.mark.skipif(not OWN, reason="Falcon's own arithmetic: transformers 5.24 and earlier")
interface_only = pytest.mark.skipif(OWN, reason="Falcon on the attention interface: transformers 5.25 and later")

_sdpa = {}


def falcon_sdpa(case):
    """Falcon under sdpa. Its attention class serves both, so transformers cannot switch it after loading
    (`set_attn_implementation` warns and keeps eager): set the config before wrapping, as loading would."""
    if case not in _sdpa:
        model = tiny_model(case)
        model.config._attn_implementation = "sdpa"
        _sdpa[case] = attnlens.StandardizedTransformer(model, tokenizer=char_tokenizer())
    return _sdpa[case]


def test_falcon_alibi_enters_as_the_installed_transformers_adds_it():
    """FalconModel folds alibi / sqrt(d) into the mask, which sdpa adds alone; transformers 5.24's eager attention
    adds (q·k + alibi) / sqrt(d) to it, the bias twice, and 5.25's eager attention q·k / sqrt(d), the bias once."""
    eager, sdpa = tiny("falcon:alibi"), falcon_sdpa("falcon:alibi")
    layer = 1
    attn = sdpa.layers[layer].self_attn
    got = trace(
        sdpa,
        lambda m: {
            "q": attn.attention_queries,
            "k": attn.attention_keys,
            "v": attn.attention_values,
            "heads": attn.attention_head_outputs,
        },
    )
    module = attn._module
    # the family's (eager) score function
    scores = eager.family.score_function().scores(
        eager.family.sizes.geometry(module, eager.family), eager.config, got["q"], got["k"], layer
    )
    bias = eager.family.alibi(4, N) * module.inv_norm_factor

    def mix(scores):
        return (scores.softmax(-1) @ got["v"]).transpose(1, 2)

    assert close(mix(scores - bias if OWN else scores), got["heads"])
    assert not close(mix(scores + bias if not OWN else scores), got["heads"], atol=1e-3)
    note = eager.support(layer).notes["self_attn.attention_scores"]
    assert ("twice under eager" if OWN else "eager and sdpa add it once") in note


@own_only
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
    assert torch.equal(model.family.score_function().scores(attn.heads, model.config, q, keys * 2, layer), scores)
    assert close(heads, torch.full_like(heads, 0.5))
    # an in-place edit of the copy could not land: it is refused, naming the value and what to do
    with pytest.raises(attnlens.EditError, match=r"layers\[1\].self_attn.attention_keys was edited in place.*Assign"):
        with torch.no_grad(), model.trace(PROMPT):
            attn.attention_keys.mul_(0)
            attn.attention_scores.save()
    note = model.support(layer).notes["self_attn.attention_keys"]
    assert note.startswith("a de-duplicated copy: _split_heads broadcasts each key/value head to its group")
    assert "in-place edits do not land" in note


@interface_only
def test_falcon_new_architecture_keys_are_one_per_group_and_edit_in_place():
    """On the attention interface the forward holds one key and value head per group: read and edited as held."""
    model = tiny("falcon:new_architecture")
    layer = 1
    attn = model.layers[layer].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    with torch.no_grad(), model.trace(PROMPT):
        q = attn.attention_queries.save()
        keys = attn.attention_keys.save()
        attn.attention_keys.mul_(2)
        scores = attn.attention_scores.save()
    assert keys.shape == (1, 2, N, 16)
    assert torch.equal(model.family.score_function().scores(attn.heads, model.config, q, keys, layer), scores)
    assert not close(scores, saved_for("falcon:new_architecture")[(layer, "attention_scores")])
    assert "de-duplicated" not in model.support(layer).notes.get("self_attn.attention_keys", "")


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


ATTENTION_ORDER = [
    "self_attn.attention_cache_keys",  # the cache as the attention enters (values and visibility share its rank)
    "self_attn.attention_queries",
    # 5.24 reads keys and values at the cache update, after the queries; 5.25 all three as the attention function's
    # arguments, at one rank
    *(["self_attn.attention_keys"] if OWN else []),
    "self_attn.attention_scores",
    "self_attn.attention_probabilities",
    "self_attn.attention_head_outputs",
    "self_attn.attention_premix",
    "self_attn.attention_output",
]


MLP_ORDER = ["mlp.mlp_activation", "mlp.mlp_neurons", "mlp.mlp_output", "layer_output"]


FALCON_ORDERS = {
    # one shared norm: the MLP's norm output is read as the MLP receives it
    "falcon": ["layer_input", "attention_norm_output", *ATTENTION_ORDER, "mlp_norm_output", *MLP_ORDER],
    "falcon:multihead": [
        "layer_input",
        "attention_norm_output",
        *ATTENTION_ORDER,
        "layer_mid",
        "mlp_norm_output",
        "mlp_input",
        *MLP_ORDER,
    ],
    # ln_mlp runs before attention
    "falcon:new_architecture": [
        "layer_input",
        "attention_norm_output",
        "mlp_norm_output",
        *ATTENTION_ORDER,
        "mlp_input",
        *MLP_ORDER,
    ],
    "falcon:alibi": [
        "layer_input",
        "attention_norm_output",
        *ATTENTION_ORDER,
        "layer_mid",
        "mlp_norm_output",
        "mlp_input",
        *MLP_ORDER,
    ],
}


@pytest.mark.parametrize("case", list(FALCON_ORDERS))
def test_falcon_order_per_layout(case):
    model = tiny(case)
    order = model.order(1)
    distinct = sorted(set(order.values()))
    firsts = [next(key for key, rank in order.items() if rank == r) for r in distinct]
    assert firsts == FALCON_ORDERS[case]
    # both from the cache update (5.24) or both arguments of the attention function (5.25)
    assert order["self_attn.attention_values"] == order["self_attn.attention_keys"]
    shared = case in ("falcon",)
    assert (order["mlp_norm_output"] == order["mlp_input"]) == shared


def test_falcon_rotary_and_alibi_bind_the_installed_transformers_operations():
    rotary, alibi = tiny("falcon:multihead"), tiny("falcon:alibi")

    def path(model, name):
        location = model.family.locations_for(model.config, 1).get(name)
        return getattr(location, "source", location).path

    if not OWN:  # one attention function serves both: the same operations
        for name in ("attention_queries", "attention_scores", "attention_probabilities"):
            assert path(rotary, name) == path(alibi, name) == path(tiny("llama"), name), name
        return
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
    with pytest.raises(
        attnlens.OrderError,
        match=r"layers\[1\].mlp_norm_output was read after "
        r"layers\[1\].self_attn.attention_queries",
    ):
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
    assert reason == (
        "a parallel block: attention and the MLP both read the block input (through "
        + norms
        + ") and the block adds both outputs to it at once, so no residual stream exists between "
        "attention and the MLP; layer_input + attention_output + mlp_output == layer_output"
    )
    with pytest.raises(attnlens.Unavailable, match="a parallel block"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].layer_mid.save()


@own_only
def test_falcon_keys_need_the_cache():
    model = tiny("falcon", use_cache=False)
    reason = model.support(1)["self_attn.attention_values"]
    assert reason == (
        "read at the cache update, which config.use_cache=False skips; load with use_cache=True (the default)"
    )
    with pytest.raises(attnlens.Unavailable, match=r"config\.use_cache=False"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].self_attn.attention_keys.save()


@interface_only
def test_falcon_keys_need_no_cache():
    """Read where the attention function receives them, which a forward without the cache runs too."""
    model = tiny("falcon", use_cache=False)
    assert "self_attn.attention_keys" not in model.support(1).unavailable
    got = trace(model, lambda m: {"k": m.layers[1].self_attn.attention_keys})
    assert torch.equal(got["k"], saved_for("falcon")[(1, "attention_keys")])


@pytest.mark.parametrize("case", ["falcon", "falcon:new_architecture", "falcon:alibi"])
def test_falcon_sdpa_serves_all_but_scores_and_pattern(case):
    sdpa = falcon_sdpa(case)
    assert sdpa.config._attn_implementation == "sdpa"
    report = sdpa.support(1)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert report[key].startswith("read inside transformers' eager attention function, but this model runs 'sdpa'")
    with pytest.raises(attnlens.Unavailable, match="'sdpa'"):
        with torch.no_grad(), sdpa.trace(PROMPT):
            sdpa.layers[1].self_attn.attention_scores.save()
    names = (
        "attention_queries",
        "attention_keys",
        "attention_values",
        "attention_head_outputs",
        "attention_premix",
        "attention_output",
    )
    layer = 1
    if case == "falcon:alibi" and OWN:  # 5.24's eager doubles ALiBi, sdpa doesn't: the mix differs from layer 0 on
        names, layer = names[:3], 0
    got = trace(sdpa, lambda m: {name: getattr(m.layers[layer].self_attn, name) for name in names})
    eager = saved_for(case)
    for name in names:
        assert close(got[name], eager[(layer, name)], atol=1e-5), name
