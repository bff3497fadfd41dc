"""The older families on vLLM, where vLLM's arithmetic or module tree is not the common one: fused projections and
LayerNorm blocks in vLLM's own ports (GPT-2, GPT-J, OPT, Bloom, Falcon), transformers' own modules in its
Transformers backend (Phi, OLMo 1-3, Starcoder2, GPT-BigCode, GPT-NeoX), and the families vLLM does not run (MPT,
GPT-Neo). test_equal_to_eager.py checks each family's default layout; this file checks Falcon's other layouts and
what is special to each family."""

import re

import pytest
import test_equal_to_eager as equal
import torch
from conftest import FAMILIES, PROMPT, Pair, pair

import attnlens
from attnlens.families.vllm_transformers import VLLMTransformersBackend

_layouts: dict = {}


def layout(name: str, tmp_path_factory) -> Pair:
    """A family's other tiny layout (`"falcon:alibi"`) on both engines, built once per session."""
    if name not in _layouts:
        family = attnlens.registered()[name.partition(":")[0]]
        folder = tmp_path_factory.mktemp(name.replace(":", "-"))
        attnlens.models.tiny_model(name, **family.vllm_tiny).save_pretrained(folder)
        attnlens.models.char_tokenizer().save_pretrained(folder)
        _layouts[name] = Pair(name, folder, PROMPT, 128, 16 * 2**20, family.vllm_dtype)
    return _layouts[name]


# --- Falcon: both architectures vLLM runs, sequential and parallel blocks, ALiBi ---------------------------------


@pytest.fixture(scope="session", params=["falcon:multihead", "falcon:new_architecture"])
def falcon(request, tmp_path_factory):
    """The sequential block (its residual is added in place on vLLM) and the new decoder architecture (grouped
    key/value heads, two norms); the default layout (multi-query, parallel) is test_equal_to_eager's."""
    return layout(request.param, tmp_path_factory)


def test_falcon_layouts_equal_eager(falcon):
    equal.test_every_value_equals_eager_on_prefill_and_decode_steps(falcon)
    equal.test_identities_hold_on_vllms_own_tensors_every_step(falcon)
    equal.test_greedy_tokens_equal_transformers(falcon)


def test_falcon_alibi_is_vllms_own_arithmetic(tmp_path_factory):
    """vLLM adds Falcon's ALiBi once, with float32 slopes times 1/sqrt(d), where transformers' eager attention adds
    it twice with bfloat16 slopes: on vLLM the pattern served is the vLLM kernel's (its @ values is the head outputs
    on every step), and the eager arithmetic on the same tensors is not."""
    import dataclasses

    models = layout("falcon:alibi", tmp_path_factory)
    model, family = models.vllm, models.vllm.family
    assert torch.equal(kernel_slopes(model)[0], family.alibi_slopes(model.text_config, 0))
    with torch.no_grad(), model.generate(PROMPT, max_new_tokens=3, do_sample=False) as tracer:
        steps = list().save()
        for _ in tracer.iter[:3]:
            attn = model.layers[1].self_attn
            steps.append([attn.attention_queries.clone(), attn.attention_keys.clone(), attn.attention_values.clone(),
                          attn.attention_probabilities.clone(), attn.attention_head_outputs.clone()])
    heads = model.layers[1].self_attn.heads
    assert heads.engine == "vllm"
    eager_arithmetic = dataclasses.replace(heads, engine="eager")
    for queries, keys, values, pattern, outputs in steps:
        values = values.repeat_interleave(heads.groups, dim=1)
        assert equal.close((pattern @ values).transpose(1, 2), outputs)
        assert equal.close(family.scores(heads, model.text_config, queries, keys, 1).softmax(-1), pattern)
        eager_pattern = family.scores(eager_arithmetic, model.text_config, queries, keys, 1).softmax(-1)
        assert not equal.close((eager_pattern @ values).transpose(1, 2), outputs)


# --- Bloom: ALiBi slopes, and vLLM's exact GELU --------------------------------------------------------------------


def kernel_slopes(model) -> list:
    """The ALiBi slopes of each layer's attention kernel in vLLM's worker (None without ALiBi)."""
    family = model.family

    def slopes(vllm_model):
        layers = vllm_model.get_submodule(family.layers)
        return [layer.get_submodule(f"{family.attention}.{family.vllm_kernel}").impl.alibi_slopes for layer in layers]

    return model.vllm_entrypoint.apply_model(slopes)[0]


def test_bloom_kernel_adds_the_familys_alibi_slopes(tmp_path_factory):
    models = pair("bloom", tmp_path_factory)
    for layer, slopes in enumerate(kernel_slopes(models.vllm)):
        assert torch.equal(slopes, models.vllm.family.alibi_slopes(models.vllm.text_config, layer))


def test_bloom_mlp_is_vllms_exact_gelu(tmp_path_factory):
    """Where vLLM's Bloom differs from transformers': its MLP's GELU is exact (erf), not Bloom's tanh approximation.
    On vLLM's tensors the activation is the exact GELU of the up projection (the eager model's weights)."""
    models = pair("bloom", tmp_path_factory)
    model = models.vllm
    assert "exact GELU" in model.support(0).notes["mlp.mlp_activation"]
    with torch.no_grad(), model.trace(PROMPT):
        up = model.layers[0].mlp_input.clone().save()
        activation = model.layers[0].mlp.mlp_activation.clone().save()
    with torch.no_grad():
        pre = models.eager._module.transformer.h[0].mlp.dense_h_to_4h(up)
        tanh = models.eager._module.transformer.h[0].mlp.gelu_impl(pre)
    assert torch.allclose(activation, torch.nn.functional.gelu(pre), atol=1e-5)
    assert (activation - tanh).abs().max() > 1e-5


# --- OPT: the kernel scales the queries ----------------------------------------------------------------------------


def test_opt_queries_and_scale_give_eagers_scores(tmp_path_factory):
    """vLLM's OPT kernel receives the queries unscaled and scales them itself; attnlens serves the queries and the
    scale the kernel has (eager: pre-scaled queries, scale 1.0). The queries differ by the scale; the scores, and the
    head summaries computed from queries, keys and scale, do not."""
    models = pair("opt", tmp_path_factory)
    assert "not pre-scaled" in models.vllm.support(0).notes["self_attn.attention_queries"]
    read = {}
    for engine, model in (("vllm", models.vllm), ("eager", models.eager)):
        with torch.no_grad(), model.trace(PROMPT):  # the body runs in vLLM's worker: only saves come back
            attn = model.layers[1].self_attn
            queries, keys = attn.attention_queries.clone().save(), attn.attention_keys.clone().save()
            scores = attn.attention_scores.clone().save()
        read[engine] = queries, keys, scores, model.layers[1].self_attn.scale
    (queries, keys, scores, scale), (eager_queries, _, eager_scores, eager_scale) = read["vllm"], read["eager"]
    assert eager_scale == 1.0 and scale == pytest.approx(queries.shape[-1] ** -0.5)
    assert equal.close(queries * scale, eager_queries) and equal.close(scores, eager_scores)
    unmasked = ~attnlens.masked(scores)
    assert torch.allclose((queries @ keys.transpose(-1, -2) * scale)[unmasked], scores[unmasked], atol=1e-5)
    summaries = [attnlens.head_summaries(model, [PROMPT], length=8, sequences=2, top_k=1, progress=False)
                 for model in (models.vllm, models.eager)]
    for metric in attnlens.heads.METRICS:
        assert torch.allclose(summaries[0].get(metric, 1), summaries[1].get(metric, 1), atol=1e-4), metric


# --- what every family here shares -----------------------------------------------------------------------------------

OWN_PORTS = [name for name in ("bloom", "falcon", "gpt2", "gptj", "opt") if name in FAMILIES]
BACKEND = [name for name in FAMILIES if issubclass(FAMILIES[name], VLLMTransformersBackend)
           and not getattr(FAMILIES[name], "vllm_own_port", False)]  # OLMo Hybrid: OLMo 2's eager, vLLM's own port


@pytest.mark.parametrize("name", BACKEND)
def test_backend_families_run_transformers_modules_in_vllm(name, tmp_path_factory):
    """The premise of VLLMTransformersBackend: vLLM runs these through its Transformers backend, whose base model is
    `model` and whose attention modules carry vLLM's kernel as `attn`."""
    model = pair(name, tmp_path_factory).vllm
    assert type(model._module).__name__ == "TransformersForCausalLM"
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
    owners = [block if name == "opt" else block.get_submodule(family.mlp)  # OPT's block runs its MLP itself
              for block in model._module.get_submodule(family.layers)]
    assert len({id(getattr(owner, family.activation)) for owner in owners}) == 1
    assert "down projection receives" in model.support(0).notes["mlp.mlp_activation"]


# --- the families vLLM does not run ----------------------------------------------------------------------------------

#: vLLM refuses their configs before building anything (MiMo-V2-Flash's refusal comes when the model is built).
REFUSED = ("gpt_neo", "mpt", "deepseek_v4")


def test_mimo_v2_flash_is_refused_before_an_engine_starts(tmp_path):
    model = attnlens.models.tiny_model("mimo_v2_flash")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(attnlens.UnknownFamily, match="hybrid_layer_pattern"):
        attnlens.StandardizedVLLM(str(tmp_path))


@pytest.mark.parametrize("name", REFUSED)
def test_a_family_vllm_does_not_run_says_why_in_vllms_words(name, tmp_path):
    """vLLM's own refusal (its model config, no engine) contains the words the family quotes, and StandardizedVLLM
    refuses the model with them before an engine starts."""
    from vllm.config import ModelConfig

    model = attnlens.models.tiny_model(name)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(tmp_path)
    family = attnlens.registered()[name]()
    quoted = re.search(r'"(.+?)"', family.vllm_refusal).group(1)
    with pytest.raises(Exception, match=re.escape(quoted)):
        ModelConfig(model=str(tmp_path))
    assert family.vllm_reason(name) == family.vllm_refusal
    with pytest.raises(attnlens.UnknownFamily, match=re.escape(quoted)):
        attnlens.StandardizedVLLM(str(tmp_path))
