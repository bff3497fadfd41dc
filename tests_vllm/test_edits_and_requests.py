"""Edits reach vLLM's forward as they reach eager's; several invokes keep separate histories, freed at the end."""

import pytest
import torch
from test_equal_to_eager import close

import attnlens

LAYER = 1


def next_logits(model, prompt, edit=None, layer=LAYER):
    """The next-token logits with `edit(attn)` applied on the prompt's forward, on either engine."""
    attn = model.layers[layer].self_attn
    with torch.no_grad(), model.trace(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0):
        if edit is not None:
            edit(attn)
        logits = model.logits[:, -1].clone().save()
    return logits


def ablate_head(attn):
    attn.attention_head_outputs[:, :, 1] = 0


def head0_copies_head1_pattern(attn):
    pattern = attn.attention_probabilities
    pattern[:, 0] = pattern[:, 1]


def uniform_scores(attn):
    attn.attention_scores = attnlens.keep_masked(attn.attention_scores, 0.0)


def scaled_values(attn):
    attn.attention_values = attn.attention_values * 2


def zero_queries(attn):
    attn.attention_queries = attn.attention_queries * 0


EDITS = [ablate_head, head0_copies_head1_pattern, uniform_scores, scaled_values, zero_queries]


@pytest.mark.parametrize("edit", EDITS, ids=[e.__name__ for e in EDITS])
def test_an_edit_changes_next_token_logits_the_same_on_both_engines(llama, edit):
    clean = next_logits(llama.vllm, llama.prompt)
    assert close(clean, next_logits(llama.eager, llama.prompt))
    edited = next_logits(llama.vllm, llama.prompt, edit)
    assert not close(edited, clean)
    assert close(edited, next_logits(llama.eager, llama.prompt, edit))


def test_one_head_ablation_on_smollm2_matches_eager(smollm2):
    def ablate(attn):
        attn.attention_head_outputs[:, :, 4] = 0

    vllm, eager = (
        next_logits(m, smollm2.prompt, ablate, layer=10) - next_logits(m, smollm2.prompt, layer=10)
        for m in (smollm2.vllm, smollm2.eager)
    )
    assert vllm.abs().max() > 1e-2 and close(eager, vllm)


def test_editing_an_earlier_row_on_a_decode_step_is_refused(llama):
    attn = llama.vllm.layers[LAYER].self_attn
    with pytest.raises(Exception, match="only this step's rows can be edited"):
        with torch.no_grad(), llama.vllm.generate(llama.prompt, max_new_tokens=2, temperature=0.0) as tracer:
            for step in tracer.iter[:2]:
                if step == 1:
                    attn.attention_keys = attn.attention_keys * 0


def test_several_invokes_keep_separate_histories_freed_at_the_end(llama):
    model = llama.vllm
    prompts = [llama.prompt, "Short", llama.prompt[::-1] + "!!"]
    attn = model.layers[2].self_attn

    def patterns(*invoked):
        with torch.no_grad(), model.trace(max_tokens=3, temperature=0.0) as tracer:
            for prompt in invoked:
                with tracer.invoke(prompt):
                    steps = list().save()
                    for _ in tracer.iter[:3]:
                        steps.append(attn.attention_probabilities.clone())
        return steps if len(invoked) > 1 else [steps]  # a name saved by several requests comes back as a list

    together = patterns(*prompts)
    assert model.kept() == [{"requests": 0, "bytes": 0, "traces": 0}]
    for prompt, steps in zip(prompts, together):
        alone = patterns(prompt)[0]
        n = len(model.tokenizer(prompt).input_ids)
        assert [p.shape[-1] for p in steps] == [n, n + 1, n + 2]
        assert all(close(a, b) for a, b in zip(alone, steps))


def scale_queries(attn):
    attn.attention_queries = attn.attention_queries * 3


def scale_this_steps_key(attn):
    keys = attn.attention_keys
    keys[:, :, -1] = keys[:, :, -1] * 3
    attn.attention_keys = keys


def flip_cached_key(attn):
    keys = attn.attention_cache_keys
    keys[:, :, 1] = keys[:, :, 1] * -2
    attn.attention_cache_keys = keys


@pytest.mark.parametrize("edit", [scale_queries, scale_this_steps_key, flip_cached_key], ids=lambda e: e.__name__)
def test_a_pattern_scored_with_other_requests_sees_its_own_earlier_edit(llama, edit):
    """A decode step's pattern is scored in one batch with those of the other requests waiting at the kernel, when
    the first of them reads it (`WorkerValues._score_ahead`). A later request that edits its queries or this step's
    key at the kernel, or its cached keys at the attention module's input, before it reads gets the pattern of what
    it edited, as it does alone; unedited, its pattern is the one it gets alone."""
    model = llama.vllm
    attn = model.layers[LAYER].self_attn
    first, second = llama.prompt, llama.prompt[::-1]

    def patterns(*invoked):
        with torch.no_grad(), model.trace(max_tokens=3, temperature=0.0) as tracer:
            for prompt, edited in invoked:
                with tracer.invoke(prompt):
                    steps = list().save()
                    for step in tracer.iter[:3]:
                        if edited and step:
                            edit(attn)
                        steps.append(attn.attention_probabilities.clone())
        return steps

    together = patterns((first, False), (second, True))
    alone, unedited = patterns((second, True)), patterns((second, False))
    assert all(close(a, b) for a, b in zip(alone, together[1]))
    assert not any(close(a, b) for a, b in zip(unedited[1:], together[1][1:]))  # the edit moved it
    assert all(close(a, b) for a, b in zip(patterns((first, False)), together[0]))


def test_logits_read_on_some_steps_are_each_steps_own_unscaled(llama):
    """A block holding a view of the logits on steps 0 and 2 of a sampled generation keeps them as the model made them:
    vLLM's sampler divides them by the temperature in place, so a step with a reader is copied for it (step 1, with
    none, is not). Against the same seeded run copying the logits inside the block on every step."""
    model, sampling = llama.vllm, dict(max_new_tokens=3, temperature=0.5, seed=7)

    def logits(steps, copy):
        with torch.no_grad(), model.generate(llama.prompt, **sampling) as tracer:
            saved = dict().save()
            for step in tracer.iter[:3]:
                if step in steps:
                    view = model.logits[:, -1]
                    saved[step] = view.clone() if copy else view
        return saved

    viewed, copied = logits({0, 2}, copy=False), logits({0, 1, 2}, copy=True)
    assert set(viewed) == {0, 2}
    for step in (0, 2):
        assert torch.equal(viewed[step], copied[step])
    assert not torch.equal(copied[0], copied[2])


def test_support_says_what_is_rebuilt_and_why_values_are_missing(llama):
    report = llama.vllm.support(layer=1)
    assert report.engine == "vllm"
    assert report["self_attn.attention_probabilities"] is None
    assert "rebuilt" in report.notes["self_attn.attention_probabilities"]
    assert "fuses" in report["mlp.mlp_activation"]
    assert report["self_attn.attention_sinks"] is not None
    model = llama.vllm  # a trace's body travels to the worker: let it name the engine, not the pair holding both
    with pytest.raises(attnlens.Unavailable, match=r"layers\[1\].mlp.mlp_activation on Llama \(vllm\): vLLM fuses"):
        with model.trace(llama.prompt, temperature=0.0):
            model.layers[1].mlp.mlp_activation.save()


def test_a_late_read_names_the_value(llama):
    attn = llama.vllm.layers[1].self_attn
    with pytest.raises(
        attnlens.OrderError,
        match=r"layers\[1\].self_attn.attention_queries was read after "
        r"layers\[1\].self_attn.attention_output",
    ):
        with llama.vllm.trace(llama.prompt, temperature=0.0):
            attn.attention_output.save()
            attn.attention_queries.save()


def test_importing_attnlens_does_not_import_vllm():
    import subprocess
    import sys

    code = (
        "import sys, attnlens; assert 'vllm' not in sys.modules; attnlens.StandardizedVLLM; "
        "assert 'vllm' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
