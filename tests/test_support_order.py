"""support(), Unavailable and order(): answered before anything runs, with reasons and names a user can act on."""

import pytest
import torch
from conftest import CORE_FAMILIES, PROMPT, tiny
from identities import read_everything

import attnlens

# Gemma 2 has no sdpa path in transformers: it loads eager only.
SDPA_FAMILIES = [f for f in CORE_FAMILIES if f != "gemma2"]


def count_forwards(model):
    calls = []
    handle = model._module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_sdpa_reports_eager_only_values_and_refuses_them_before_the_forward(family):
    model = tiny(family, attn_implementation="sdpa")
    report = model.support(layer=1)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert "attn_implementation='eager'" in report[key] and "'sdpa'" in report[key]
    for key in (
        "self_attn.attention_premix",
        "self_attn.attention_output",
        "self_attn.attention_queries",
        "self_attn.attention_head_outputs",
        "layer_input",
        "logits",
    ):
        assert report[key] is None
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(attnlens.Unavailable, match="attn_implementation='eager'"):
            with model.trace(PROMPT):
                model.layers[1].self_attn.attention_probabilities.save()
        assert calls == []
    finally:
        handle.remove()


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_values_read_under_sdpa_equal_eager(family):
    eager, sdpa = tiny(family), tiny(family, attn_implementation="sdpa")
    got = {}
    for name, model in (("eager", eager), ("sdpa", sdpa)):
        attn = model.layers[1].self_attn
        with torch.no_grad(), model.trace(PROMPT):
            got[name] = (
                attn.attention_queries.save(),
                attn.attention_head_outputs.save(),
                attn.attention_premix.save(),
            )
    for a, b in zip(got["eager"], got["sdpa"]):
        assert torch.allclose(a, b, atol=1e-5)


def test_support_is_a_mapping_and_prints_as_a_table():
    report = tiny("llama").support(layer=0)
    listed = [v for v in attnlens.values.ALL_VALUES if v.name not in attnlens.values.WITH_CROSS_ATTENTION]
    assert next(iter(report)) == "layer_input" and len(report) == len(listed)  # no cross-attention here
    absent = ["self_attn.attention_position_bias", "self_attn.attention_sinks", "self_attn.attention_gate"]
    assert report.available == [key for key in report if key not in absent]
    assert "sums to one" in report["self_attn.attention_sinks"]
    text = str(report)
    assert "self_attn.attention_probabilities" in text and "available" in text
    with pytest.raises(KeyError, match="not a standardized value"):
        report["attention_probs"]


def test_support_checks_the_layer():
    with pytest.raises(IndexError, match=r"\[0, 3\)"):
        tiny("llama").support(layer=7)


def test_order_ranks_every_value(family):
    order = tiny(family).order(1)
    assert len(order) == 21  # 18, and the KV cache's keys, values and visibility
    assert (
        order["self_attn.attention_queries"] == order["self_attn.attention_keys"] == order["self_attn.attention_values"]
    )
    ranks = list(order.values())
    assert ranks == sorted(ranks) and ranks[0] == 0
    assert (
        order["self_attn.attention_scores"]
        < order["self_attn.attention_probabilities"]
        < order["self_attn.attention_head_outputs"]
        < order["self_attn.attention_premix"]
        < order["self_attn.attention_output"]
        < order["layer_output"]
    )


def test_reading_in_order_succeeds_everywhere(family):
    # read_everything walks model.order() over every layer in one trace: it raises if the order is wrong.
    saved = read_everything(tiny(family), PROMPT)
    assert len(saved) == 3 * 21 + 3


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("attention_output", "attention_probabilities"),
        ("attention_head_outputs", "attention_scores"),
        ("attention_premix", "attention_queries"),
    ],
)
def test_out_of_order_read_names_both_values(family, first, second):
    model = tiny(family)
    attn = model.layers[1].self_attn
    with pytest.raises(attnlens.OrderError) as error:
        with model.trace(PROMPT):
            getattr(attn, first).save()
            getattr(attn, second).save()
    message = str(error.value)
    assert f"layers[1].self_attn.{second} was read after layers[1].self_attn.{first}" in message
    assert "source." not in message  # no nnsight-internal paths


def test_out_of_order_across_layers():
    model = tiny("llama")
    with pytest.raises(attnlens.OrderError, match=r"layers\[0\].layer_output was read after layers\[2\].layer_input"):
        with model.trace(PROMPT):
            model.layers[2].layer_input.save()
            model.layers[0].layer_output.save()


def test_an_unknown_family_loads_with_the_block_values_and_says_how_to_add_it(monkeypatch):
    from transformers import DogeConfig, DogeForCausalLM

    from attnlens import registry

    registry.registered()  # the built-in families, loaded; Doge's taken away: a type attnlens has no family for
    monkeypatch.delitem(registry._BUILT_IN, "doge")
    torch.manual_seed(0)
    config = DogeConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=128,
    )
    inner = DogeForCausalLM(config).eval()
    with pytest.warns(attnlens.UnknownFamilyWarning, match="attnlens.register") as warned:
        model = attnlens.StandardizedTransformer(inner, tokenizer=attnlens.models.char_tokenizer())
    assert "layers[i].layer_input" in str(warned[0].message)
    report = model.support(1)
    assert report.available == ["layer_input", "layer_output", "embeddings", "logits"]
    assert "docs/extending.md" in report["self_attn.attention_probabilities"]
    with torch.no_grad(), model.trace(PROMPT):
        block_in = model.layers[0].layer_input.save()
        block_out = model.layers[0].layer_output.save()
        logits = model.logits.save()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        states = inner(ids, output_hidden_states=True)
    assert torch.allclose(block_in, states.hidden_states[0]) and torch.allclose(block_out, states.hidden_states[1])
    assert torch.allclose(logits, states.logits)
    with pytest.raises(attnlens.Unavailable, match=r"docs/extending\.md"):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_queries.save()


def test_a_moved_operation_fails_at_load_naming_family_and_value():
    class Renumbered(attnlens.Family):
        model_types = ("llama",)
        eager = attnlens.EagerFunction(scores=("attn_weights_0", "+ attention_mask"))

    with pytest.raises(attnlens.LocationDrift) as error:
        attnlens.StandardizedTransformer(
            attnlens.models.tiny_model("llama"), family=Renumbered, tokenizer=attnlens.models.char_tokenizer()
        )
    message = str(error.value)
    assert "family Renumbered, value attention_scores" in message
    assert "attn_weights_1: `attn_weights = attn_weights + attention_mask`" in message


def test_a_module_replaced_under_its_envoy_is_read_afresh():
    """A read keeps the operation envoy of a module's forward (`locations.operation`); a module replaced under its
    envoy (nnsight's `_update`, as when real weights are dispatched) is instrumented and read, not the old one."""
    model = tiny("llama")
    attn = model.layers[0].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        before = attn.attention_queries.save()
    old = attn._module
    replacement = type(old)(old.config, layer_idx=0)
    replacement.load_state_dict(old.state_dict())
    with torch.no_grad():
        replacement.q_proj.weight.mul_(2)  # the queries double (no bias; rotary is linear)
    model.layers[0]._module.self_attn = replacement
    attn._update(replacement)
    with torch.no_grad(), model.trace(PROMPT):
        after = attn.attention_queries.save()
    torch.testing.assert_close(after, before * 2)
