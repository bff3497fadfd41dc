"""HRM-Text on vLLM: refused, and the measurement the refusal quotes (attnlens/families/hrm_text.py)."""

import gc

import pytest
import torch
from conftest import PROMPT, engine_args

import attnlens


def checkpoint(folder, prefix_lm: bool):
    """A tiny HRM-Text vLLM's CPU kernels accept (head size 32), saved with the character tokenizer."""
    import transformers

    config = transformers.HrmTextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=32,
        H_cycles=2,
        L_cycles=2,
        pad_token_id=0,
        bos_token_id=1,
        initializer_range=0.2,
        max_position_embeddings=128,
        prefix_lm=prefix_lm,
    )
    torch.manual_seed(0)
    model = transformers.HrmTextForCausalLM(config)
    with torch.no_grad():  # z_L_init starts at zero: perturbed, a low stack's initial state that is not read shows
        model.model.z_L_init.add_(torch.randn_like(model.model.z_L_init) * 0.1)
    model.save_pretrained(folder)
    attnlens.models.char_tokenizer().save_pretrained(folder)


def test_hrm_text_is_refused_before_an_engine_starts(tmp_path):
    checkpoint(tmp_path, prefix_lm=True)
    with pytest.raises(attnlens.UnknownFamily, match="bidirectionally") as error:
        attnlens.StandardizedVLLM(str(tmp_path))
    assert "PrefillPrefixLMAttention" in str(error.value)


def test_vllm_runs_the_prompt_bidirectionally_even_where_the_config_says_causal(tmp_path):
    """The refusal's measurement, on a checkpoint saved with `prefix_lm=False` (transformers then runs it causal
    whatever the inputs): vLLM's prompt log-probabilities are transformers' with the whole prompt as the PrefixLM block
    (the same weights loaded with `prefix_lm=True`, `token_type_ids=1`), far from the causal ones, and so are its
    greedy tokens. A vLLM that runs the prompt causally where the config says so fails here: then check the family's
    vLLM locations, serve `prefix_lm=False` checkpoints and drop or narrow the refusal."""
    import transformers
    from vllm import LLM, SamplingParams

    checkpoint(tmp_path, prefix_lm=False)
    ids = attnlens.models.char_tokenizer()(PROMPT).input_ids
    x = torch.tensor([ids])
    causal = transformers.HrmTextForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prefix = transformers.HrmTextForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", prefix_lm=True)
    prefix.eval()
    marked = {"token_type_ids": torch.ones_like(x)}  # the whole prompt one bidirectional block
    with torch.no_grad():
        expected = {
            "causal": causal(x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0],
            "prefix": prefix(x, **marked).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0],
        }
        tokens = prefix.generate(x, **marked, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(ids) :]
    llm = LLM(str(tmp_path), enforce_eager=True, **engine_args(128, 16 * 2**20))
    try:
        sampling = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
    finally:
        del llm
        gc.collect()
    on_vllm = torch.tensor([next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]])
    assert (on_vllm - expected["prefix"]).abs().max() < 1e-4
    assert (on_vllm - expected["causal"]).abs().max() > 1.0  # 4.07 when measured
    assert list(out.outputs[0].token_ids) == tokens.tolist()
