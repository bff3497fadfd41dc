"""ALBERT: one shared AlbertLayer run many times, `model.layers[i]` its i-th application (`attnlens.applications`).

Every value is compared with transformers' own output (`output_attentions`, `output_hidden_states`: exact), or, for
an edit, with the forward recomputed by hand from the modules' weights (float32, atol 1e-5)."""

import pytest
import torch
import transformers
from test_encoders import assert_equal_to_transformers

import attnlens
from attnlens.families.albert import applications

PROMPT = "Hello world"
SIZES = dict(
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=128,
    embedding_size=32,
    initializer_range=0.2,
)


def albert(head="AlbertForMaskedLM", **config):
    """A tiny ALBERT (a masked LM unless `head` names another class; eager, float32, seeded, perturbed as the suites'
    models are) and the encoder over it."""
    config = transformers.AlbertConfig(**{"num_hidden_layers": 3, **SIZES, "pad_token_id": 0, **config})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    inner = attnlens.models._perturbed(getattr(transformers, head)(config).eval())
    return attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer()), inner


@pytest.fixture(scope="module")
def shared():
    """Three applications of one AlbertLayer (the released checkpoints' layout), and transformers' own outputs."""
    model, inner = albert()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = inner(ids, output_attentions=True, output_hidden_states=True)
    return model, inner, ids, reference


#: (num_hidden_layers, num_hidden_groups, inner_group_num): one module three times; two groups of two steps; two inner
#: layers per step (num_layers counts each); three groups over four steps (uneven: 0, 0, 1, 2) of two inner layers.
LAYOUTS = [(3, 1, 1), (4, 2, 1), (2, 1, 2), (4, 3, 2)]


@pytest.mark.parametrize(("steps", "groups", "inner_layers"), LAYOUTS)
def test_every_application_is_transformers_own_call(steps, groups, inner_layers):
    """`layers[i]` is the i-th AlbertLayer call: its module is the one `AlbertTransformer.forward` runs there, and
    every value, pattern and block output equals transformers' on one prompt and a padded batch (test_encoders)."""
    model, inner = albert(num_hidden_layers=steps, num_hidden_groups=groups, inner_group_num=inner_layers)
    assert model.num_layers == steps * inner_layers == len(model.layers)
    calls = []
    hooks = [
        module.register_forward_hook(lambda module, args, output: calls.append(module))
        for module in inner.modules()
        if isinstance(module, transformers.models.albert.modeling_albert.AlbertLayer)
    ]
    try:
        with torch.no_grad():
            inner(torch.tensor([[5, 6, 7]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert [model.layers[i]._module for i in range(model.num_layers)] == calls
    assert [inner.get_submodule(path) for path in applications(inner.config)] == calls
    assert_equal_to_transformers(model, inner)


@pytest.mark.parametrize("head", ["AlbertModel", "AlbertForSequenceClassification"])
def test_other_heads_serve_the_same_applications(head):
    """A bare AlbertModel (its paths rebased: no `albert.` prefix, the applications' paths with them) and a classifier:
    the same comparison with transformers."""
    model, inner = albert(head, num_hidden_groups=3)
    assert len({model.layers[i]._module for i in range(3)}) == 3
    assert_equal_to_transformers(model, inner)


def test_a_later_application_read_alone_or_after_an_earlier_one_is_its_own(shared):
    """The reads that bind by occurrence: a drilled operation (the softmax inside the eager function) read first on
    application 2, or after the forward has passed application 0's attention; nnsight's own `.output` and `.input`
    on an application, and the attention's operation reached through `.source`."""
    model, _, _, reference = shared
    saved = {}
    with torch.no_grad(), model.trace(PROMPT):
        saved["alone"] = model.layers[2].self_attn.attention_probabilities.save()
    with torch.no_grad(), model.trace(PROMPT):
        saved["output 0"] = model.layers[0].layer_output.save()
        saved["scores 1"] = model.layers[1].self_attn.attention_scores.save()
        saved["raw output 1"] = model.layers[1].output.save()
        saved["raw input 2"] = model.layers[2].input.save()
        saved["pattern 2"] = model.layers[2].self_attn.attention_probabilities.save()
        saved["interface 2"] = model.layers[2].self_attn.source.attention_interface_1.output[1].save()
    assert torch.equal(saved["alone"], reference.attentions[2])
    assert torch.equal(saved["output 0"], reference.hidden_states[1])
    assert torch.equal(saved["scores 1"].softmax(-1), reference.attentions[1])
    assert torch.equal(saved["raw output 1"], reference.hidden_states[2])
    assert torch.equal(saved["raw input 2"], reference.hidden_states[2])
    assert torch.equal(saved["interface 2"], reference.attentions[2])
    assert torch.equal(saved["pattern 2"], reference.attentions[2])
    assert not torch.equal(reference.attentions[1], reference.attentions[2])  # the applications do differ


def test_each_invoke_binds_its_own_applications(shared):
    model, _, _, reference = shared
    saved = {}
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(PROMPT):
            saved[0] = model.layers[0].self_attn.attention_probabilities.save()
        with tracer.invoke(PROMPT):
            saved[2] = model.layers[2].self_attn.attention_probabilities.save()
    assert torch.equal(saved[0], reference.attentions[0]) and torch.equal(saved[2], reference.attentions[2])


def test_an_application_read_after_the_forward_passed_it_is_refused(shared):
    """Out of order, standardized (the ranks) or nnsight's own (`.output` then `.input` of one application: nnsight
    would serve a later call's): `OrderError`, never another application's value."""
    model = shared[0]
    with pytest.raises(attnlens.OrderError), torch.no_grad(), model.trace(PROMPT):
        model.layers[1].layer_output.save()
        model.layers[0].layer_output.save()
    with pytest.raises(attnlens.OrderError, match=r"layers\[0\]"), torch.no_grad(), model.trace(PROMPT):
        model.layers[1].output.save()
        model.layers[0].output.save()
    with pytest.raises(attnlens.OrderError, match=r"layers\[1\]"), torch.no_grad(), model.trace(PROMPT):
        model.layers[1].self_attn.output.save()
        model.layers[1].input.save()  # nnsight alone would bind it to application 2's input
    with pytest.raises(attnlens.OrderError, match=r"layers\[2\]"), torch.no_grad(), model.trace(PROMPT):
        model.layers[2].output.save()
        model.layers[2].input.save()  # the last call: nothing later to bind to


def by_hand(inner, ids, edits=None):
    """ALBERT's forward from its modules' weights, each application's pattern replaced where `edits` names it
    ({application: pattern}): the block outputs and the logits."""
    edits = edits or {}
    albert = inner.albert
    stream = albert.encoder.embedding_hidden_mapping_in(albert.embeddings(ids))
    outputs = []
    for index, path in enumerate(applications(inner.config)):
        layer = inner.get_submodule(path)
        attention = layer.attention
        q, k, v = (
            projection(stream).unflatten(-1, (attention.num_attention_heads, -1)).transpose(1, 2)
            for projection in (attention.query, attention.key, attention.value)
        )
        pattern = edits.get(index, ((q @ k.transpose(-1, -2)) * attention.scaling).softmax(-1))
        merged = (pattern @ v).transpose(1, 2).flatten(-2)
        mid = attention.LayerNorm(stream + attention.dense(merged))
        stream = layer.full_layer_layer_norm(layer.ffn_output(layer.activation(layer.ffn(mid))) + mid)
        outputs.append(stream)
    return outputs, inner.predictions(stream)


def test_an_edit_of_one_applications_pattern_moves_it_and_the_later_ones_only(shared):
    """Application 1's pattern set to read the first key only: application 0 is transformers' own, exactly;
    applications 1 and 2 and the logits move (by 0.1 at least: ten thousand times the tolerance) as the forward
    recomputed by hand with that pattern predicts (atol 1e-5); application 1's head outputs are that pattern over its
    own values."""
    model, inner, ids, reference = shared
    with torch.no_grad():
        unedited, logits = by_hand(inner, ids)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(unedited, reference.hidden_states[1:]))
    assert torch.allclose(logits, reference.logits, atol=1e-5)  # the hand forward is transformers'
    length = ids.shape[1]
    first = torch.zeros(1, model.config.num_attention_heads, length, length)
    first[..., 0] = 1
    saved = {}
    with torch.no_grad(), model.trace(PROMPT):
        saved["pattern 0"] = model.layers[0].self_attn.attention_probabilities.save()
        saved["output 0"] = model.layers[0].layer_output.save()
        model.layers[1].self_attn.attention_probabilities = first
        saved["head outputs 1"] = model.layers[1].self_attn.attention_head_outputs.save()
        saved["output 1"] = model.layers[1].layer_output.save()
        saved["pattern 2"] = model.layers[2].self_attn.attention_probabilities.save()
        saved["output 2"] = model.layers[2].layer_output.save()
        saved["logits"] = model.logits.save()
    with torch.no_grad():
        edited, edited_logits = by_hand(inner, ids, {1: first})
    assert torch.equal(saved["pattern 0"], reference.attentions[0])
    assert torch.equal(saved["output 0"], reference.hidden_states[1])
    for layer in (1, 2):
        assert torch.allclose(saved[f"output {layer}"], edited[layer], atol=1e-5), layer
        assert (saved[f"output {layer}"] - reference.hidden_states[layer + 1]).abs().max() > 0.1, layer
    assert (saved["pattern 2"] - reference.attentions[2]).abs().max() > 1e-2
    assert torch.allclose(saved["logits"], edited_logits, atol=1e-5)
    assert (saved["logits"] - reference.logits).abs().max() > 0.1
    values = inner.albert.encoder.albert_layer_groups[0].albert_layers[0].attention.value
    with torch.no_grad():  # the head outputs are the first pattern over application 1's own values
        v = values(reference.hidden_states[1]).unflatten(-1, (4, -1)).transpose(1, 2)
    assert torch.allclose(saved["head outputs 1"], (first @ v).transpose(1, 2), atol=1e-6)
    with torch.no_grad():  # and the edit lasted one trace only
        after = inner(ids, output_attentions=True).attentions
    assert all(torch.equal(a, b) for a, b in zip(after, reference.attentions))


def test_a_shared_weight_is_every_applications(shared):
    """One module, so one weight: what `support()` says, and an edit of it moves every application's pattern."""
    model, inner, ids, reference = shared
    assert model.layers[0]._module is model.layers[2]._module
    assert "an edit of one moves every application" in model.support(2).notes["layer_input"]
    assert "call 2 of it" in model.support(2).notes["layer_input"]
    weight = model.layers[1].self_attn._module.query.weight
    kept = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(2)
            doubled = inner(ids, output_attentions=True).attentions
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert all(not torch.allclose(a, b, atol=1e-3) for a, b in zip(doubled, reference.attentions))


def test_support_and_the_factorised_embeddings(shared):
    model, inner, _, reference = shared
    report = model.support(0)
    assert report["attention_norm_output"] and report["final_norm_output"]
    assert "embedding_size" in report.notes["embeddings"]
    with torch.no_grad(), model.trace(PROMPT):
        embeddings = model.embeddings.save()
        first = model.layers[0].layer_input.save()
    assert embeddings.shape[-1] == inner.config.embedding_size != first.shape[-1]
    assert torch.equal(first, reference.hidden_states[0])
    assert model.order(0) == model.order(2)


def test_a_skipped_application_skips_that_call_only(shared):
    """nnsight's `skip` on `layers[1]`: call 1 returns its input, and call 2 runs the shared layer on it (recomputed
    with the module itself, atol 1e-6); application 0 runs as transformers' does."""
    model, _, _, reference = shared
    saved = {}
    with torch.no_grad(), model.trace(PROMPT):
        saved[0] = model.layers[0].layer_output.save()
        model.layers[1].skip(model.layers[1].input)
        saved[1] = model.layers[1].layer_output.save()
        saved[2] = model.layers[2].layer_output.save()
    with torch.no_grad():
        expected = model.layers[2]._module(reference.hidden_states[1])
    assert torch.equal(saved[0], reference.hidden_states[1]) and torch.equal(saved[1], reference.hidden_states[1])
    assert torch.allclose(saved[2], expected, atol=1e-6)
