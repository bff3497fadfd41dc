"""At scale: chunked prefill and many requests in one trace. Each is checked against the transformers engine on the
same weights (or against each request alone). Tensor parallelism: test_tensor_parallel.py; pipeline parallelism:
test_pipeline_parallel.py."""

import torch
from conftest import engine_args
from test_equal_to_eager import close, read_steps

import attnlens

LONG = "The quick brown fox jumps over the lazy dog, again and again and again!"  # 71 tokens: five chunks of 16


def joined(steps, name, layer, prompt_length):
    """The prefill's rows of `name`, joined from the chunk steps along the query axis (the keys a chunk cannot see yet
    filled in as masked)."""
    rows = []
    for step in steps:
        tensor = step[(layer, name)]
        if sum(r.shape[2] for r in rows) >= prompt_length:
            break
        fill = torch.finfo(tensor.dtype).min if name == "attention_scores" else 0.0
        rows.append(torch.nn.functional.pad(tensor, (0, prompt_length - tensor.shape[-1]), value=fill))
    return torch.cat(rows, dim=2)


def test_chunked_prefill_gives_each_chunks_rows_against_every_earlier_key(llama):
    model = attnlens.StandardizedVLLM(
        str(llama.path),
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        **engine_args(128, 16 * 2**20),
    )
    n = len(llama.eager.tokenizer(LONG).input_ids)
    names = ("attention_scores", "attention_probabilities", "attention_head_outputs")
    reads = [(1, "self_attn", name) for name in names]
    chunks = -(-n // 16)
    steps = read_steps(model, LONG, reads, steps=chunks + 2)
    assert [step[(1, "attention_probabilities")].shape[2:] for step in steps] == [
        (16, 16),
        (16, 32),
        (16, 48),
        (16, 64),
        (n - 64, n),
        (1, n + 1),
        (1, n + 2),
    ]
    eager = read_steps(llama.eager, LONG, reads, steps=1)[0]
    for name in ("attention_scores", "attention_probabilities"):
        assert close(joined(steps, name, 1, n), eager[(1, name)]), name
    heads = torch.cat([step[(1, "attention_head_outputs")] for step in steps[:chunks]], dim=1)
    assert close(heads, eager[(1, "attention_head_outputs")])
    # decode steps after a chunked prefill are the unchunked engine's
    tokens = model.generate(LONG, max_tokens=6, temperature=0.0)[0].outputs[0].token_ids
    assert tokens == llama.vllm.generate(LONG, max_tokens=6, temperature=0.0)[0].outputs[0].token_ids


def test_32_requests_in_one_trace_each_equal_its_run_alone(llama):
    model = llama.vllm
    prompts = [LONG[: 5 + 2 * i] for i in range(32)]
    attn = model.layers[1].self_attn

    def read(*invoked):
        with torch.no_grad(), model.trace(max_tokens=2, temperature=0.0) as tracer:
            for prompt in invoked:
                with tracer.invoke(prompt):
                    steps = list().save()
                    for _ in tracer.iter[:2]:
                        steps.append((attn.attention_probabilities.clone(), model.logits.clone()))
        return steps if len(invoked) > 1 else [steps]  # a name saved by several requests comes back as a list

    together = read(*prompts)
    assert len(together) == 32 and model.kept() == [{"requests": 0, "bytes": 0, "traces": 0}]
    for prompt, steps in zip(prompts, together):
        alone = read(prompt)[0]
        assert [p.shape for p, _ in steps] == [p.shape for p, _ in alone]
        for (p, logits), (p_alone, logits_alone) in zip(steps, alone):
            assert close(p, p_alone) and close(logits, logits_alone)


def test_saved_values_travel_home_as_they_were_and_compact():
    """The worker's pickler for saved values (`payload.dumps_results`): every kind of tensor arrives equal, with its
    dtype, shape and strides (of the dimensions longer than one); one object saved under two names stays one; a view
    of a larger buffer carries only its own bytes; what it does not write as bytes (a parameter, a tensor needing its
    gradient, a conjugate view) goes as nnsight writes it."""
    import pickle

    from attnlens.vllm.payload import dumps_results

    buffer = torch.randn(64, 32)
    kinds = [
        buffer,
        buffer[3:5],
        buffer.t(),
        buffer.to(torch.bfloat16),
        buffer > 0,
        torch.arange(7),
        torch.tensor(2.5),
        torch.empty(0, 3),
        torch.tensor(1.5).expand(1),  # one element, stride 0: contiguous
        torch.nn.Parameter(buffer[:2].clone()),
        buffer[:2].clone().requires_grad_(),
        torch.randn(3, dtype=torch.complex64).conj(),
    ]
    back = pickle.loads(dumps_results({"kinds": kinds, "again": kinds[0]}))
    for sent, arrived in zip(kinds, back["kinds"], strict=True):
        strides = [(a, b) for a, b, size in zip(arrived.stride(), sent.stride(), sent.shape, strict=True) if size > 1]
        assert type(arrived) is type(sent) and arrived.dtype == sent.dtype and all(a == b for a, b in strides)
        assert torch.equal(arrived.detach().resolve_conj(), sent.detach().resolve_conj())
        assert arrived.requires_grad == sent.requires_grad
    assert back["again"] is back["kinds"][0]
    kept = buffer.clone()
    arrived = pickle.loads(dumps_results(buffer[3:5]))
    arrived += 1  # its own memory, writable
    assert len(dumps_results(buffer[3:5])) < 2 * 2 * 32 * 4 and torch.equal(buffer, kept)


def test_an_engine_shutting_down_in_this_process_leaves_the_other_engines_running(llama):
    """vLLM's in-process engine core tears down the process-wide model-parallel groups when it shuts down (the
    tensor-parallel engine on the `mp` executor does, as does any engine collected): the single-rank engines still
    in the process build them again and run on, to the same greedy tokens."""
    from vllm.distributed import parallel_state

    def tokens():
        return list(llama.vllm.generate(LONG, max_tokens=4, temperature=0.0)[0].outputs[0].token_ids)

    before = tokens()
    parallel_state.cleanup_dist_env_and_memory()  # what an engine's shutdown runs
    assert not parallel_state.model_parallel_is_initialized()
    assert tokens() == before
    assert parallel_state.model_parallel_is_initialized()
