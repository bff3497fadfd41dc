"""A family is checked against the model it loads (attnlens/verification.py): every miswiring a user can write into a
family for a model of their own is refused at load with `attnlens.Miswired` (or `LocationDrift`) naming what is
wrong, and the right family still serves every value exactly.

The model is `attnlens.toys.gated_toy_model()`: module names of its own, 4 query and 2 key/value heads split from one
projection, its own masked softmax, a gate per head and token before the output projection, RMSNorms whose gain is
`g`, no `hidden_size` in its config, no `get_input_embeddings`."""

import warnings
from dataclasses import replace

import pytest
import torch

import attnlens
from attnlens import registry
from attnlens.checks import failures, read_everything
from attnlens.locations import insert_after
from attnlens.parts.gates import repeated_head_gate
from attnlens.toys import gated_toy_model, toy_model

PROMPT = "Hello world, again"


class Gated(attnlens.Family):
    model_types = ("gated_toy",)
    layers, embed_tokens, final_norm = "model.blocks", "model.wte", "model.norm_f"
    attention, mlp, attention_norm, mlp_norm = "mixer", "ff", "norm1", "norm2"
    output_projection, activation, down_projection = "out", "1", "2"
    eager = attnlens.EagerFunction(only=())
    sizes = attnlens.Sizes(num_heads=("n_q",), num_kv_heads=("n_kv",), head_dim=("d",), scale=("scale",))

    def locations(self):
        found = {
            **super().locations(),
            "attention_queries": attnlens.Operation(("fused_split_0",), item=0, anchor="split"),
            "attention_keys": attnlens.Operation(("fused_split_0",), item=1, anchor="split"),
            "attention_values": attnlens.Operation(("fused_split_0",), item=2, anchor="split"),
            "attention_scores": attnlens.Operation(("logits_1",), anchor="masked_fill"),
            "attention_probabilities": attnlens.Operation(("weights_0",), anchor="softmax"),
            "attention_head_outputs": attnlens.Operation(("heads_0",), anchor="transpose"),
        }
        gate = repeated_head_gate(attnlens.Operation(("gate_0",), anchor="sigmoid"))
        return insert_after(found, "attention_head_outputs", "attention_gate", gate)

    class ScoreFunction(attnlens.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            keys = keys.repeat_interleave(heads.num_heads // heads.num_kv_heads, dim=1)
            scores = torch.matmul(queries, keys.transpose(-1, -2)) * heads.scale
            n, m = queries.shape[2], keys.shape[2]
            future = torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(m - n + 1)
            return scores.masked_fill(future, torch.finfo(scores.dtype).min)


def load(family=Gated, model=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attnlens.StandardizedTransformer(
            model or gated_toy_model(), tokenizer=attnlens.models.char_tokenizer(), family=family, **kwargs
        )


def variant(**members):
    return type("Miswired", (Gated,), members)


def reading(**changed):
    """Gated with some values read elsewhere."""
    return variant(locations=lambda self: {**Gated.locations(self), **changed})


def without(name):
    return variant(locations=lambda self: {k: v for k, v in Gated.locations(self).items() if k != name})


SPLIT = ("fused_split_0",)

#: name -> (the miswired family, the error, words its message must hold: the value or member, and the identity).
MISWIRINGS = {
    "scores read before the mask": (
        reading(attention_scores=attnlens.Operation(("logits_0",))),
        attnlens.Miswired,
        ["softmax(scores) == probabilities", "where attention_scores is read"],
    ),
    "queries at the keys' operation": (
        reading(attention_queries=attnlens.Operation(SPLIT, item=1)),
        attnlens.Miswired,
        ["attention_queries layout", "expected shape (1, 4, 6, 16), found (1, 2, 6, 16)"],
    ),
    "values at the keys' operation": (
        reading(attention_values=attnlens.Operation(SPLIT, item=1)),
        attnlens.Miswired,
        ["probabilities @ values == head outputs", "attention_values"],
    ),
    "num_heads at the key/value head count": (
        variant(sizes=replace(Gated.sizes, num_heads=("n_kv",))),
        attnlens.Miswired,
        ["attention_queries layout [batch num_heads seq qk_head_dim]: expected shape (1, 2, 6, 16)"],
    ),
    "the key/value head count wrong": (
        variant(sizes=replace(Gated.sizes, num_kv_heads=("n_q",))),
        attnlens.Miswired,
        ["attention_keys layout [batch num_kv_heads seq qk_head_dim]: expected shape (1, 4, 6, 16)"],
    ),
    "the head size wrong": (
        variant(sizes=replace(Gated.sizes, head_dim=(8,))),
        attnlens.Miswired,
        ["attention_values layout [batch num_kv_heads seq head_dim]: expected shape (1, 2, 6, 8)"],
    ),
    "the scale wrong": (
        variant(sizes=replace(Gated.sizes, scale=(0.3,))),
        attnlens.Miswired,
        ["scores == family score function", "sizes.scale"],
    ),
    "a size attribute that does not exist": (
        variant(sizes=replace(Gated.sizes, head_dim=("head_size",))),
        attnlens.Miswired,
        ["GatedAttention has none of ('head_size',) for its head_dim", "n_q=4, n_kv=2, d=16"],
    ),
    "the output projection at another module": (
        variant(output_projection="qkv"),
        attnlens.Miswired,
        ["attention_premix", "output_projection = 'qkv'"],
    ),
    "the MLP norm at another module": (
        variant(mlp_norm="norm1"),
        attnlens.Miswired,
        ["layer_mid", "mlp_norm = 'norm1'"],
    ),
    "the final norm at another module": (
        variant(final_norm="model.blocks.1.norm2"),
        attnlens.Miswired,
        ["final_norm_output", "final_norm = 'model.blocks.1.norm2'"],
    ),
    "the final norm at the unembedding": (
        variant(final_norm="lm_head"),
        attnlens.Miswired,
        ["final_norm_output layout [batch seq hidden]: expected shape (1, 6, 64), found (1, 6, 128)"],
    ),
    "the final norm's input read for its output": (
        reading(final_norm_output=attnlens.ModuleInput("model.norm_f")),
        attnlens.Miswired,
        ["logits == unembedding(final norm output), up to a logit scale", "check final_norm"],
    ),
    "an attention path that does not exist": (
        variant(attention="mixr"),
        attnlens.Miswired,
        ["attention = 'mixr' names no module of block 0", "its modules: norm1, mixer, norm2, ff"],
    ),
    "layers naming one block": (
        variant(layers="model.blocks.0"),
        attnlens.Miswired,
        ["layers = 'model.blocks.0' names a GatedBlock, not a list of blocks", "model.blocks (2)"],
    ),
    "an operation that does not exist": (
        reading(attention_scores=attnlens.Operation(("logits_5",), anchor="masked_fill")),
        attnlens.LocationDrift,
        ["value attention_scores", "the model's own code, attnlens.toys", "differs from what the family states"],
    ),
    "no output gate where the model has one": (
        without("attention_gate"),
        attnlens.Miswired,
        ["merged head outputs == premix", "an output gate it does not read (attention_gate)"],
    ),
    "the embeddings at another module": (
        variant(embed_tokens="model.blocks.0.norm1"),
        attnlens.Miswired,
        ["embeddings (embed_tokens = 'model.blocks.0.norm1')"],
    ),
    "the pattern at the scores": (
        reading(attention_probabilities=attnlens.Operation(("logits_1",))),
        attnlens.Miswired,
        ["rows sum to one", "masked entries exactly zero"],
    ),
    "the gate listed out of forward order": (
        variant(
            locations=lambda self: {
                **without("attention_gate").locations(self),
                "attention_gate": repeated_head_gate(attnlens.Operation(("gate_0",))),
            }
        ),
        attnlens.Miswired,
        ["attention_gate was requested after the forward pass had computed it", "out of forward order"],
    ),
}


@pytest.mark.parametrize("case", MISWIRINGS)
def test_a_miswiring_is_refused_at_load_naming_what_is_wrong(case):
    family, error, words = MISWIRINGS[case]
    with pytest.raises(error) as raised:
        load(family)
    for said in words:
        assert said in str(raised.value)


def test_verify_false_loads_a_miswired_family_unchecked():
    model = load(MISWIRINGS["the scale wrong"][0], verify=False)
    assert model.family.name == "Miswired"


def test_the_right_family_serves_every_value_as_computed_by_hand():
    model = load()
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], []]
    inner = model._module.model
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        block = inner.blocks[0]
        attention = block.mixer
        x = block.norm1(inner.wte(ids))
        fused = attention.qkv(x).view(1, ids.shape[1], 8, 16).transpose(1, 2)
        q, k, v = fused[:, :4], fused[:, 4:6].repeat_interleave(2, 1), fused[:, 6:].repeat_interleave(2, 1)
        scores = q @ k.transpose(-1, -2) / 4
        scores = scores.masked_fill(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1), -torch.inf)
        pattern = scores.softmax(-1)
        heads = (pattern @ v).transpose(1, 2)
        gate = torch.sigmoid(attention.gate(x))
        output = attention.out((heads * gate[..., None]).flatten(-2))
    assert torch.allclose(saved[(0, "attention_probabilities")], pattern, atol=1e-6)
    assert torch.allclose(saved[(0, "attention_head_outputs")], heads, atol=1e-6)
    assert torch.allclose(saved[(0, "attention_gate")], gate[..., None].expand_as(heads), atol=1e-6)
    assert torch.allclose(saved[(0, "attention_output")], output, atol=1e-6)


def test_the_hidden_size_embeddings_and_norm_gain_come_through_the_family():
    model = load()
    assert not hasattr(model.config, "hidden_size")
    report = model.support()
    assert report.analyses["attribution"] is None, report.analyses
    result = attnlens.attribution(model, PROMPT, target=5)
    assert torch.allclose(result.total, result.value, atol=1e-4) and result.unsplit == {}
    with pytest.raises(ValueError, match=r"direction must be \[64\]"):
        attnlens.attribution(model, PROMPT, direction=torch.ones(63))


def test_a_norm_with_its_gain_named_g_is_frozen_with_it():
    from attnlens.analysis.reasons import final_norm_form

    model = load()
    form = final_norm_form(model)
    assert form.name == "RMSNorm" and torch.equal(form.gain, model._module.model.norm_f.g.float())


def test_an_unknown_model_without_get_input_embeddings_still_serves_its_embeddings(monkeypatch):
    monkeypatch.delitem(registry._REGISTERED, "gated_toy", raising=False)
    with pytest.warns(attnlens.UnknownFamilyWarning):
        model = attnlens.StandardizedTransformer(gated_toy_model(), tokenizer=attnlens.models.char_tokenizer())
    assert model.support(0).available == ["layer_input", "layer_output", "embeddings", "logits"]
    with torch.no_grad(), model.trace(PROMPT):
        embeddings = model.embeddings.save()
    assert embeddings.shape[-1] == 64


def test_a_model_without_a_kv_cache_serves_no_cache_values_and_says_why():
    report = load().support(0)
    for name in ("attention_cache_keys", "attention_cache_values", "attention_cache_visible"):
        assert report[f"self_attn.{name}"].startswith("the model keeps no KV cache: its attention (GatedAttention")


def test_a_read_only_derived_value_says_why_it_is_read_only():
    model = load()
    source = attnlens.Operation(("gate_0",))
    bare = attnlens.Derived(source, lambda envoy, gate: gate[..., None].expand(-1, -1, -1, 16).clone())
    gated = load(reading(attention_gate=bare))
    for loaded, why in ((model, "one factor per head"), (gated, "no way to write it back")):
        with pytest.raises(attnlens.EditError, match=why), loaded.trace(PROMPT):
            loaded.layers[0].self_attn.attention_gate = torch.zeros(1, 18, 4, 16)


def test_a_model_without_a_tokenizer_says_to_pass_one():
    with pytest.raises(ValueError, match="pass tokenizer="):
        attnlens.StandardizedTransformer(toy_model(), family=Gated)


def test_a_built_in_family_opts_in_and_a_miswired_one_is_refused():
    model = attnlens.models.tiny_model("llama")
    tokenizer = attnlens.models.char_tokenizer()
    assert attnlens.StandardizedTransformer(model, tokenizer=tokenizer, verify=True).family.name == "Llama"
    llama = attnlens.family_for("llama")
    wrong = type("Scaled", (type(llama),), {"sizes": replace(llama.sizes, scale=(0.5,))})
    with pytest.raises(attnlens.Miswired, match="scores == family score function"):
        attnlens.StandardizedTransformer(model, tokenizer=tokenizer, family=wrong)
