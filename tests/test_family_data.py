"""What `Family.__init_subclass__` does with a family's data: attnlens 0.1's spellings (eleven `vllm_*` members, a
method per size, a plain `tiny` tuple with `tiny_layouts`) fold into the one value each became, and a vLLM refusal
speaks only for the model types of the family that states it."""

import types

import pytest

import attnlens
from attnlens.family import Family, Tiny
from attnlens.parts.vllm import VLLMLayout
from attnlens.registry import registered


def _family(name, bases=(Family,), **members):
    return types.new_class(name, bases, exec_body=lambda namespace: namespace.update(members))


def test_the_legacy_vllm_members_fold_into_one_layout_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"vllm_model_types, vllm_refusal are deprecated"):
        legacy = _family("Legacy", model_types=("legacy",), vllm_model_types=("legacy",), vllm_refusal="no kernel")
    assert legacy.vllm == VLLMLayout(model_types=("legacy",), refusal="no kernel")
    assert Family.vllm == VLLMLayout()  # the parent's value is untouched


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
        ("hy_v4", "not checked for model type 'hy_v4'"),
        ("axk2", "not checked for model type 'axk2'"),
        ("dots3_note", "not checked for model type 'dots3_note'"),
    ],
)
def test_the_sparse_attention_families_refuse_in_their_own_words(model_type, words):
    family = registered()[model_type]()
    assert words in family.vllm.refused(family, model_type)


def test_served_types_are_never_refused():
    family = attnlens.registered()["llama"]()
    assert family.vllm.refused(family, "llama") is None
