"""Head summaries on vLLM are computed inside the worker, from the kernel's queries and the kept keys, and equal the
transformers engine's on the same weights."""

import torch

import attnlens


def test_head_summaries_on_vllm_equal_eager(llama):
    prompts = [llama.prompt, "Short prompt"]
    on = {
        engine: attnlens.head_summaries(model, prompts, length=12, sequences=3, top_k=2, progress=False)
        for engine, model in (("vllm", llama.vllm), ("eager", llama.eager))
    }
    assert on["vllm"].layers == on["eager"].layers == [0, 1, 2]
    for metric in attnlens.heads.METRICS:
        for layer in on["eager"].layers:
            assert torch.allclose(on["vllm"].get(metric, layer), on["eager"].get(metric, layer), atol=1e-4), metric
    for layer in on["eager"].layers:  # the same top keys of each prompt's last row, head by head
        for got, want in zip(on["vllm"].top[layer], on["eager"].top[layer]):
            assert [[key[0] for key in head] for head in got["keys"]] == [
                [key[0] for key in head] for head in want["keys"]
            ]
