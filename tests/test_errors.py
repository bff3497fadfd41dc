"""Mistakes cannot pass silently: every write is checked against its layout, read-only values refuse every write,
errors are typed and name what was wrong and what to do. (tests_vllm/test_errors.py asks the same of vLLM.)"""

import re

import pytest
import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.models import char_tokenizer, tiny_model

LAYER = 1
N = len(PROMPT)


def write(model, edit, layer=LAYER):
    """Run `edit(attn)` in a trace of the prompt, returning the logits."""
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        edit(attn)
        logits = model.logits.save()
    return logits


# --- writes are checked against the layout with this run's sizes ------------------------------------------------


def heads_first(attn):
    attn.attention_head_outputs = attn.attention_head_outputs.transpose(1, 2).clone()


def no_batch_axis(attn):
    attn.attention_head_outputs = attn.attention_head_outputs[0].clone()


def merged_heads(attn):
    attn.attention_head_outputs = torch.zeros(1, N, 64)  # the premix's layout


def keys_per_query_head(attn):
    attn.attention_keys = attn.attention_keys.repeat_interleave(2, dim=1)


def wrong_hidden(attn):
    attn.attention_output = torch.zeros(1, N, 32)


WRONG = {
    heads_first: (
        "attention_head_outputs",
        "[batch=1, seq=18, num_heads=4, head_dim=16]",
        "[1, 4, 18, 16]",
        "looks like [batch, num_heads, seq, head_dim]",
    ),
    no_batch_axis: (
        "attention_head_outputs",
        "[batch=1, seq=18, num_heads=4, head_dim=16]",
        "[18, 4, 16]",
        "no batch axis",
    ),
    merged_heads: (
        "attention_head_outputs",
        "[batch=1, seq=18, num_heads=4, head_dim=16]",
        "[1, 18, 64]",
        "unflatten it with new.unflatten(-1, (4, 16))",
    ),
    keys_per_query_head: (
        "attention_keys",
        "[batch=1, num_kv_heads=2, seq=18, qk_head_dim=16]",
        "[1, 4, 18, 16]",
        "groups its 4 query heads over 2 key/value heads",
    ),
    wrong_hidden: ("attention_output", "[batch=1, seq=18, hidden=64]", "[1, 18, 32]", ""),
}


@pytest.mark.parametrize("edit", list(WRONG), ids=[edit.__name__ for edit in WRONG])
def test_a_write_of_another_shape_names_value_layout_and_shape(edit):
    name, layout, got, hint = WRONG[edit]
    with pytest.raises(attnlens.EditError) as error:
        write(tiny("llama"), edit)
    message = str(error.value)
    assert message.startswith(f"layers[{LAYER}].self_attn.{name} expects a tensor of layout {layout}; got shape {got}")
    assert hint in message and "Nothing was written" in message


def test_same_shape_tensors_and_numbers_are_written():
    model = tiny("llama")
    clean = write(model, lambda attn: None)
    zeroed = write(model, lambda attn: setattr(attn, "attention_head_outputs", 0))
    by_tensor = write(
        model, lambda attn: setattr(attn, "attention_head_outputs", torch.zeros_like(attn.attention_head_outputs))
    )
    assert not torch.allclose(zeroed, clean) and torch.equal(zeroed, by_tensor)


def test_a_write_of_another_dtype_lands_in_the_models_dtype():
    model = tiny("llama")
    by_double = write(model, lambda attn: setattr(attn, "attention_premix", attn.attention_premix.double() * 0))
    assert torch.equal(by_double, write(model, lambda attn: setattr(attn, "attention_premix", 0)))


# --- read-only values refuse in-place edits as they refuse assignment ---------------------------------------------


def rebuilding(family="llama"):
    return attnlens.StandardizedTransformer(
        tiny_model(family, attn_implementation="sdpa"), tokenizer=char_tokenizer(), rebuild_patterns=True
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda attn: attn.attention_probabilities.__setitem__(slice(None), 0),
        lambda attn: attn.attention_scores[..., 0].__iadd__(100),
        lambda attn: setattr(attn, "attention_probabilities", attn.attention_probabilities * 0),
    ],
    ids=["probabilities[:] = 0", "scores[..., 0] += 100", "assigned"],
)
def test_rebuilt_patterns_refuse_every_write(edit):
    with pytest.raises(
        attnlens.EditError,
        match=r"attention_(probabilities|scores).*rebuilt from the queries and "
        r"keys.*edit the queries or keys",
    ):
        write(rebuilding(), edit)


def test_an_in_place_edit_of_a_rebuilt_pattern_is_refused_even_as_the_last_read():
    model = rebuilding()
    with pytest.raises(attnlens.EditError, match="was edited in place"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[LAYER].self_attn.attention_probabilities.zero_()


def test_the_sink_share_refuses_every_write():
    model = tiny("gpt_oss")
    with pytest.raises(attnlens.EditError, match="sink column, which the forward drops"):
        write(model, lambda attn: attn.attention_sinks.zero_(), layer=0)
    with pytest.raises(attnlens.EditError, match="read-only"):
        write(model, lambda attn: setattr(attn, "attention_sinks", 0), layer=0)


def test_an_edited_copy_lands_once_assigned():
    """CTRL's embeddings are a snapshot (CTRLModel scales the tensor in place right after): editing the copy in place
    is refused (tests/families/test_ctrl.py), assigning the edited copy lands."""
    model = tiny("ctrl")

    def logits(edit):
        with torch.no_grad(), model.trace(PROMPT):
            edit(model)
            out = model.logits.save()
        return out

    def edit_then_assign(model):
        embeddings = model.embeddings
        embeddings[:, 0] = 0
        model.embeddings = embeddings

    assert not torch.allclose(logits(edit_then_assign), logits(lambda model: None))


# --- layers ---------------------------------------------------------------------------------------------------


def test_layer_indices_follow_python_and_name_the_range():
    model = tiny("llama")
    with pytest.raises(IndexError, match=r"layer 3 is out of range: this model has 3 layers.*\[0, 3\)"):
        model.layers[3]
    with pytest.raises(IndexError, match="layer -4 is out of range"):
        model.layers[-4]
    assert model.layers[-1].path == model.layers[2].path
    assert model.support(-1).layer == 2 and model.order(-1) == model.order(2)
    with pytest.raises(IndexError, match="layer 7 is out of range"):
        model.support(7)
    with pytest.raises(IndexError, match="layer -9 is out of range"):
        model.order(-9)
    with pytest.raises(TypeError, match="a layer index is an int"):
        model.support("1")


# --- loading ----------------------------------------------------------------------------------------------------


def test_torch_dtype_is_accepted_as_dtype(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    model = attnlens.StandardizedTransformer(str(tmp_path), torch_dtype=torch.bfloat16)
    assert model._module.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="not both"):
        attnlens.StandardizedTransformer(str(tmp_path), torch_dtype=torch.bfloat16, dtype=torch.float32)


def test_family_by_name_and_unknown_names_list_the_known():
    model = attnlens.StandardizedTransformer(tiny_model("llama"), tokenizer=char_tokenizer(), family="mistral")
    assert model.family.name == "Mistral"
    with pytest.raises(attnlens.UnknownFamily, match=r"'lama'.*registered: .*'?llama'?, "):
        attnlens.StandardizedTransformer(tiny_model("llama"), tokenizer=char_tokenizer(), family="lama")
    with pytest.raises(attnlens.UnknownFamily, match=r"registered: .*mistral"):
        attnlens.models.tiny("lama")
    with pytest.raises(TypeError, match="family= takes"):
        attnlens.StandardizedTransformer(tiny_model("llama"), tokenizer=char_tokenizer(), family=3)


# --- empty and misspelled input ---------------------------------------------------------------------------------


def count_forwards(model):
    calls = []
    handle = model._module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "the prompt is an empty string"),
        ([], "the list of prompts is empty"),
        (torch.zeros(1, 0, dtype=torch.long), "token ids are empty"),
    ],
    ids=["empty string", "empty list", "no ids"],
)
def test_an_empty_prompt_is_refused_before_anything_runs(prompt, message):
    model = tiny("llama")
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(ValueError, match=message):
            with torch.no_grad(), model.trace(prompt):
                model.logits.save()
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (lambda m: attnlens.capture_attention(m, [], [0]), "the list of prompts is empty"),
        (lambda m: attnlens.capture_attention(m, "", [0]), "the prompt is an empty string"),
        (lambda m: attnlens.capture_attention(m, PROMPT, []), "the list of layers is empty"),
        (lambda m: attnlens.run_with_cache(m, PROMPT, []), "no names given"),
        (lambda m: attnlens.run_with_cache(m, [PROMPT, ""], ["logits"]), "the prompt is an empty string"),
    ],
    ids=["capture no prompts", "capture empty prompt", "capture no layers", "cache no names", "cache one empty"],
)
def test_empty_capture_input_is_refused_before_anything_runs(run, message):
    model = tiny("llama")
    calls, handle = count_forwards(model)
    try:
        with pytest.raises(ValueError, match=message):
            run(model)
    finally:
        handle.remove()
    assert calls == []


def test_a_misspelled_value_suggests_the_standardized_names():
    model = tiny("llama")
    with pytest.raises(
        AttributeError,
        match=r"attention_probs'. Did you mean "
        r"model.layers\[i\].self_attn.attention_probabilities",
    ):
        getattr(model.layers[LAYER].self_attn, "attention_probs")  # noqa: B009  the misspelling under test
    with pytest.raises(
        AttributeError,
        match=r"attention_probabilities is read on model.layers\[i\].self_attn, not "
        r"on model.layers\[i\]",
    ):
        getattr(model.layers[LAYER], "attention_probabilities")  # noqa: B009  asked on the wrong envoy
    with pytest.raises(KeyError, match=r"'attn_prob' is not a cache name. Did you mean .*attention_probabilities"):
        attnlens.run_with_cache(model, PROMPT, ["attn_prob.1"])


def test_an_attribute_error_inside_a_read_is_shown_not_taken_for_a_missing_value(monkeypatch):
    """Python answers an AttributeError raised inside a property by asking `__getattr__`, whose "no attribute
    'attention_keys'" would hide the real error (a config without `layer_types`): it leaves as a RuntimeError."""
    model = tiny("llama")

    def broken(*_):
        raise AttributeError("'LlamaConfig' object has no attribute 'layer_types'")

    monkeypatch.setattr(model.access, "read", broken)
    monkeypatch.setattr(model.access, "write", broken)
    attn = model.layers[LAYER].self_attn
    failed = r"attention_keys at \S*layers\.1\.self_attn failed inside attnlens: AttributeError: .*'layer_types'"
    with pytest.raises(RuntimeError, match="reading " + failed):
        attn.attention_keys  # noqa: B018  the read under test
    with pytest.raises(RuntimeError, match="writing " + failed):
        attn.attention_keys = 0


@pytest.mark.parametrize("name", ["self_attn.attention_probabilities", "layer_input", "mlp.mlp_output"])
def test_a_value_read_or_written_outside_a_trace_says_to_read_it_inside_one(name):
    model = tiny("llama")
    host, _, value = name.rpartition(".")
    envoy = model.layers[LAYER] if not host else getattr(model.layers[LAYER], host)
    where = rf"layers\[{LAYER}\]\.{re.escape(name)} is (read|written) inside a trace, while the forward runs"
    with pytest.raises(attnlens.OutsideTrace, match=where.replace("(read|written)", "read")):
        getattr(envoy, value)
    with pytest.raises(attnlens.OutsideTrace, match=where.replace("(read|written)", "written")):
        setattr(envoy, value, torch.zeros(1))


# --- gradients ----------------------------------------------------------------------------------------------------


def test_a_gradient_of_a_rebuilt_pattern_says_it_is_outside_the_graph():
    model = rebuilding()
    attn = model.layers[LAYER].self_attn
    with pytest.raises(
        attnlens.Unavailable,
        match=r"gradient of layers\[1\].self_attn.attention_probabilities.*"
        r"rebuilt from the queries and keys",
    ):
        with model.trace(PROMPT):
            pattern = attn.attention_probabilities
            loss = model.logits.sum()
            with loss.backward():
                pattern.grad.save()


def test_gradients_of_standardized_values_equal_retain_grad():
    model = tiny("llama")
    attn = model.layers[LAYER].self_attn
    with model.trace(PROMPT):
        heads = attn.attention_head_outputs
        logits = model.logits
        loss = logits[0, -1, 5] - logits[0, -1, 7]
        with loss.backward():
            grad = heads.grad.save()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    inner = model._module
    kept = {}

    def keep(module, args, kwargs):
        premix = args[0]
        premix.retain_grad()
        kept["premix"] = premix

    handle = inner.model.layers[LAYER].self_attn.o_proj.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        out = inner(ids).logits
        (out[0, -1, 5] - out[0, -1, 7]).backward()
    finally:
        handle.remove()
    assert torch.allclose(grad, kept["premix"].grad.view(1, N, 4, 16), atol=1e-6)
