"""Windows vLLM runs otherwise than transformers, in families on vLLM's own model code: Cohere 2's sliding layers see
one key more (vLLM passes `sliding_window + 1`), and Qwen2-MoE's layers attend to the whole context where its config
mixes sliding and full layers (vLLM passes no per-layer window). Each engine is checked against transformers on the
same weights, run with the window vLLM runs: every value on the prefill and two decode steps, and greedy tokens."""

import pytest
import torch
from conftest import PROMPT, engine_args
from test_equal_to_eager import STEPS, compare, plan, read_steps

import attnlens

#: case -> (model type, the checkpoint's config, what transformers needs to run what vLLM runs, a sliding layer,
#: words of its note on vLLM).
CASES = {
    "cohere2": ("cohere2", {"head_dim": 32}, {"sliding_window": 5}, 0, "one more than transformers'"),
    "qwen2_moe:mixed": (
        "qwen2_moe",
        {"hidden_size": 128, "head_dim": 32},
        {"use_sliding_window": False},
        0,
        "full attention on vLLM",
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model_type, config, reference, layer, words = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param.replace(":", "-"))
    attnlens.models.tiny_model(model_type, **config).save_pretrained(folder)
    attnlens.models.char_tokenizer().save_pretrained(folder)
    vllm = attnlens.StandardizedVLLM(str(folder), **engine_args(128, 16 * 2**20))
    same_weights = attnlens.models.tiny_model(model_type, **config, **reference)  # one seed: the same weights
    eager = attnlens.StandardizedTransformer(
        same_weights, tokenizer=attnlens.models.char_tokenizer(), attn_implementation="eager"
    )
    return request.param, vllm, eager, layer, words


def test_values_equal_transformers_run_with_the_window_vllm_runs(case):
    name, vllm, eager, layer, words = case
    assert (
        vllm.family.score_function().sliding_window(vllm.text_config, layer) is not None
    )  # the checkpoint slides there
    assert words in vllm.support(layer).notes["self_attn.attention_probabilities"]
    reads = plan(vllm, range(vllm.num_layers))
    on_vllm, on_eager = read_steps(vllm, PROMPT, reads), read_steps(eager, PROMPT, reads)
    assert len(on_vllm) == len(on_eager) == STEPS
    pattern = on_vllm[0][(layer, "attention_probabilities")]  # the prefill's last query sees vLLM's window
    window = vllm.family.score_function("vllm").window(vllm.text_config, layer) or pattern.shape[-1]
    assert ((pattern[0, :, -1] > 0).sum(-1) == window).all()
    worst = compare(on_vllm, on_eager, name=name)
    print(name, {k: f"{v:.1e}" for k, v in worst.items()})


def test_greedy_tokens_equal_transformers_run_with_that_window(case):
    _name, vllm, eager, _, _ = case
    ids = eager.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = eager._module.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    outputs = vllm.generate(PROMPT, max_tokens=8, temperature=0.0)
    assert list(outputs[0].outputs[0].token_ids) == expected[0, ids.shape[1] :].tolist()
