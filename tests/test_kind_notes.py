"""Notes and reasons as data: `Family.kind_notes` / `kind_reasons` keyed by the layer's kinds, formatted from the
config, shown by `support()` on exactly the layers they select, and raised as the reason of a read."""

import pytest

import attnlens
from attnlens import Family, Joined
from attnlens.families.llama import Llama
from attnlens.parts.notes import selects
from attnlens.values import ALL_VALUES, BY_NAME

KEYS = {value.key: value.name for value in ALL_VALUES}


class OddLlama(Llama):
    """Llama whose odd layers are tagged "odd": the notes and reasons below select by that tag."""

    model_types = ()

    def layer_kind(self, config, layer):
        return super().layer_kind(config, layer) | ({"odd"} if layer % 2 else set())

    kind_notes = {
        "*": {"logits": "over {config.vocab_size} tokens"},
        "odd": {"attention_queries": lambda family, config, layer: f"odd layer {layer} of {family.name}"},
        "!odd": {"attention_keys": "an even layer of {config.num_hidden_layers}"},
        "odd transformers": {"attention_queries": Joined("on transformers")},
        "odd vllm": {"attention_queries": Joined("on vLLM")},
    }
    kind_reasons = {"odd": {"mlp_neurons": "layer {layer} is odd"}}


class OddChild(OddLlama):
    """A subclass's table applies on top of its parent's (a parent's notes() override included); None drops a note."""

    kind_notes = {"odd": {"attention_queries": Joined("the child's", before=True)}, "!odd": {"attention_keys": None}}


@pytest.fixture(scope="module")
def model():
    model = attnlens.models.tiny_model("llama", num_hidden_layers=4)
    return attnlens.StandardizedTransformer(model, tokenizer=attnlens.models.char_tokenizer(), family=OddLlama)


def test_selectors():
    tags = frozenset({"odd", "vllm"})
    assert selects("*", tags) and selects("odd", tags) and selects("odd vllm", tags) and selects("!moe", tags)
    assert not selects("!odd", tags) and not selects("odd transformers", tags) and not selects("moe", tags)


def test_notes_come_from_the_table_on_exactly_the_layers_of_their_kind(model):
    for layer in range(4):
        notes = {KEYS[key]: note for key, note in model.support(layer).notes.items()}
        assert notes["logits"] == "over 128 tokens"
        if layer % 2:
            assert notes["attention_queries"] == f"odd layer {layer} of OddLlama; on transformers"
            assert "attention_keys" not in notes
        else:
            assert "attention_queries" not in notes
            assert notes["attention_keys"] == "an even layer of 4"


def test_engine_words_select_the_engine():
    config = attnlens.models.tiny_model("llama").config
    assert OddLlama().notes(config, 1, "vllm")["attention_queries"] == "odd layer 1 of OddLlama; on vLLM"


def test_reasons_come_from_the_table_and_are_raised(model):
    neurons = BY_NAME["mlp_neurons"].key
    assert model.support(1).reasons[neurons] == "layer 1 is odd"
    assert model.support(0).reasons[neurons] is None
    with pytest.raises(attnlens.Unavailable, match="layer 3 is odd"):
        with model.trace("ab"):
            model.layers[3].mlp.mlp_neurons.save()


def test_a_subclass_table_applies_over_its_parents():
    config = attnlens.models.tiny_model("llama").config
    notes = OddChild().notes(config, 1)
    assert notes["attention_queries"] == "the child's; odd layer 1 of OddChild; on transformers"
    assert "attention_keys" in OddLlama().notes(config, 0) and "attention_keys" not in OddChild().notes(config, 0)


def test_families_state_their_notes_as_tables():
    """The built-in families keep their kind-keyed notes as data: a Mixtral-like MoE note, a hybrid's mixer note."""
    from attnlens.families.granitemoehybrid import GraniteMoeHybrid

    assert "mixer" in GraniteMoeHybrid.kind_notes and "routed" in GraniteMoeHybrid.kind_reasons
    assert isinstance(Family.kind_notes, dict) and not Family.kind_notes
