"""The older families on vLLM, where vLLM's arithmetic or module tree is not the common one: fused projections and
LayerNorm blocks in vLLM's own ports (GPT-2, GPT-J, OPT, Bloom, Falcon), transformers' own modules in its
Transformers backend (Phi, OLMo 1-3, Starcoder2, GPT-BigCode, GPT-NeoX), and the families vLLM does not run (MPT,
GPT-Neo, DeepSeek-V4): what every family of each kind shares. A family's own tests are in
tests_vllm/families/test_<family>.py."""

import re

import pytest
from conftest import FAMILIES, engine_args, pair

import attnlens

OWN_PORTS = [name for name in ("bloom", "falcon", "gpt2", "gptj", "opt") if name in FAMILIES]
BACKEND = [name for name in FAMILIES if FAMILIES[name].vllm.backend == "transformers"]


@pytest.mark.parametrize("name", BACKEND)
def test_backend_families_run_transformers_modules_in_vllm(name, tmp_path_factory):
    """The premise of `transformers_backend`: vLLM runs these through its Transformers backend, whose base model is
    `model` and whose attention modules carry vLLM's kernel as `attn`."""
    model = pair(name, tmp_path_factory).vllm
    # vLLM's backend class for a mixture of experts (FlexOlmo, HunYuan MoE) fuses the experts itself
    assert type(model._module).__name__ in ("TransformersForCausalLM", "TransformersMoEForCausalLM")
    block = model._module.get_submodule(f"{model.family.path('layers', 'vllm')}.0")
    assert type(block).__module__.startswith(f"transformers.models.{name}.")
    assert type(block.get_submodule(f"{model.family.attention}.attn")).__name__ == "Attention"


@pytest.mark.parametrize("name", OWN_PORTS + BACKEND)
def test_support_on_vllm_names_a_reason_or_serves_every_value(name, tmp_path_factory):
    """Every value of every layer is served or has a reason on vLLM, and the pattern is served."""
    model = pair(name, tmp_path_factory).vllm
    for layer in range(model.num_layers):
        report = model.support(layer)
        assert report["self_attn.attention_probabilities"] is None
        assert all(reason is None or reason.strip() for reason in report.reasons.values())


@pytest.mark.parametrize("name", OWN_PORTS)
def test_own_ports_share_one_activation_module(name, tmp_path_factory):
    """Why `mlp_activation` is read at the down projection on vLLM's own ports: `get_act_fn` hands every layer the
    same module, whose output nnsight cannot tell apart by layer."""
    model = pair(name, tmp_path_factory).vllm
    family = model.family
    owners = [
        block if name == "opt" else block.get_submodule(family.mlp)  # OPT's block runs its MLP itself
        for block in model._module.get_submodule(family.layers)
    ]
    assert len({id(getattr(owner, family.activation)) for owner in owners}) == 1
    assert "down projection receives" in model.support(0).notes["mlp.mlp_activation"]


REFUSED = ("gpt_neo", "mpt", "deepseek_v4")


@pytest.mark.parametrize("name", REFUSED)
def test_a_family_vllm_does_not_run_says_why_in_vllms_words(name, tmp_path):
    """vLLM's own refusal (its model config, no engine) contains the words the family quotes, and StandardizedVLLM
    refuses the model with them before an engine starts."""
    from vllm.config import ModelConfig

    model = attnlens.models.tiny_model(name)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp_path)
    family = attnlens.registered()[name]()
    quoted = re.search(r'"(.+?)"', family.vllm.refusal).group(1)
    with pytest.raises(Exception, match=re.escape(quoted)):
        ModelConfig(model=str(tmp_path))
    assert family.vllm.refused(family, name) == family.vllm.refusal
    with pytest.raises(attnlens.UnknownFamily, match=re.escape(quoted)):
        attnlens.StandardizedVLLM(str(tmp_path))


def test_vllm_cannot_load_dbrx_as_its_refusal_says(tmp_path):
    """DBRX's refusal quotes vLLM 0.32's load error: plain vLLM raises it on the tiny checkpoint (a vLLM that loads
    it fails here: check the family's locations and serve it), and StandardizedVLLM refuses before an engine starts."""
    from vllm import LLM

    family = attnlens.registered()["dbrx"]()
    missing = re.search(r"KeyError: '(.+?)'", family.vllm.refusal).group(1)
    attnlens.models.tiny_model("dbrx").save_pretrained(tmp_path)
    attnlens.models.char_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(KeyError, match=re.escape(missing)):
        LLM(str(tmp_path), enforce_eager=True, **engine_args(128, 16 * 2**20))
    with pytest.raises(attnlens.UnknownFamily, match="cannot load DBRX"):
        attnlens.StandardizedVLLM(str(tmp_path))
