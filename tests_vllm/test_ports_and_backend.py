"""The older families on vLLM, where vLLM's arithmetic or module tree is not the common one: fused projections and
LayerNorm blocks in vLLM's own ports (GPT-2, GPT-J, OPT, Bloom, Falcon), transformers' own modules in its
Transformers backend (Phi, OLMo 1-3, Starcoder2, GPT-BigCode, GPT-NeoX), and the families vLLM does not run (MPT,
GPT-Neo, DeepSeek-V4, XGLM, TrOCR, OpenAI GPT, GPT-NeoX-Japanese): what every family of each kind shares. A
family's own tests are in tests_vllm/families/test_<family>.py."""

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


REFUSED = ("gpt_neo", "mpt", "deepseek_v4", "xglm", "trocr", "openai-gpt", "gpt_neox_japanese")


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


def test_vllm_runs_gemma3n_text_without_its_per_layer_token_embeddings_as_its_refusal_says(tmp_path):
    """Gemma 3n text's refusal: on the tiny checkpoint with the per-layer-input branch on (AltUp's
    correct_output_scale off zero), plain vLLM's log-probabilities differ from transformers' and equal those of
    transformers run without the per-layer token embeddings, on the prompt and on 6 greedy decode steps (a vLLM that
    adds them fails here: check the family's locations and serve it); given them, as vLLM's multimodal class computes
    them, vLLM equals transformers; StandardizedVLLM refuses before an engine starts."""
    import torch
    from vllm import LLM, SamplingParams

    family = attnlens.registered()["gemma3n_text"]()
    model = attnlens.models.tiny_model("gemma3n_text", **family.vllm.tiny)
    model.generation_config.eos_token_id = None
    torch.manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:  # transformers initialises the scale at zero, which closes the branch
            layer.altup.correct_output_scale.add_(torch.randn_like(layer.altup.correct_output_scale) * 0.5)
    model.save_pretrained(tmp_path)
    attnlens.models.char_tokenizer().save_pretrained(tmp_path)
    ids = attnlens.models.char_tokenizer()("Hello world, again", return_tensors="pt").input_ids
    steps = 6

    def log_probabilities():
        """Each next token's log-probability on the prompt, then the greedy tokens and theirs."""
        with torch.no_grad():
            greedy = dict(max_new_tokens=steps, do_sample=False, pad_token_id=0)
            run = model.generate(ids, **greedy, output_logits=True, return_dict_in_generate=True)
            prompt = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        tokens = run.sequences[0, ids.shape[1] :]
        chosen = torch.stack([logits[0].log_softmax(-1)[t] for logits, t in zip(run.logits, tokens)])
        return torch.cat([prompt, chosen]), tokens.tolist()

    eager, eager_tokens = log_probabilities()
    model.model.get_per_layer_inputs = lambda input_ids: None  # what vLLM's Gemma3nForCausalLM computes
    without, without_tokens = log_probabilities()
    sampling = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, prompt_logprobs=0, logprobs=0)

    def on_vllm():
        [output] = llm.generate({"prompt_token_ids": ids[0].tolist()}, sampling)
        generated = output.outputs[0]
        rows = [*zip(output.prompt_logprobs[1:], ids[0, 1:].tolist()), *zip(generated.logprobs, generated.token_ids)]
        return torch.tensor([row[token].logprob for row, token in rows]), list(generated.token_ids)

    def with_token_embeddings(causal_lm):
        """Gemma3nForCausalLM given the per-layer token embeddings, as Gemma3nForConditionalGeneration's
        embed_input_ids computes them for its forward."""
        plain, config = causal_lm.forward, causal_lm.config

        def forward(input_ids, positions, **arguments):
            embeddings = causal_lm.model.get_per_layer_input_embeddings(input_ids)
            arguments["per_layer_inputs"] = embeddings.reshape(
                -1, config.num_hidden_layers, config.hidden_size_per_layer_input
            )
            return plain(input_ids, positions, **arguments)

        causal_lm.forward = forward

    llm = LLM(str(tmp_path), enforce_eager=True, enable_prefix_caching=False, **engine_args(128, 16 * 2**20))
    try:
        plain, plain_tokens = on_vllm()
        llm.apply_model(with_token_embeddings)
        fed, fed_tokens = on_vllm()
    finally:
        llm.llm_engine.engine_core.shutdown()
    print("vLLM against transformers:", (plain - eager).abs().max(), "without:", (plain - without).abs().max())
    print("vLLM given the per-layer token embeddings, against transformers:", (fed - eager).abs().max())
    assert plain_tokens == without_tokens
    assert torch.allclose(plain, without, atol=1e-4)
    assert (plain - eager).abs().max() > 0.1
    # the rest of vLLM's Gemma 3n is transformers' arithmetic: given them, it computes transformers' values
    assert fed_tokens == eager_tokens
    assert torch.allclose(fed, eager, atol=1e-4)
    with pytest.raises(attnlens.UnknownFamily, match="never adds the per-layer token embeddings"):
        attnlens.StandardizedVLLM(str(tmp_path))
