"""Every family served on vLLM, under vLLM's defaults (the compiled model, prefix caching, chunked prefill, as an
engine built for static capture runs): a trace there reads the values its kernel is handed (`static.taps`' "kernel"
ones: queries, keys, values, and the scores and pattern rebuilt from them, where the family's kernel receives them as
served) on the prefill and every decode step as the engine for traces reads them, which test_equal_to_eager holds to
transformers' values. A family whose kernel is handed none of them (latent attention: the kernel's arguments are not
the served heads) has no static tap the compiled engine could hold, and says so when one is declared.

Tolerance: the family's (`conftest.tolerance`: 1e-4 relative in float32, 3e-2 in bfloat16): the two engines run the
same kernel on the same weights, the compiled model's other operations fused by inductor."""

import pytest
import torch
from conftest import FAMILIES, pair, tolerance
from test_equal_to_eager import close

import attnlens
from attnlens.values import BY_SHORT
from attnlens.vllm.static import taps

STEPS = 3


def kernel_taps(model) -> tuple[int, list[str]]:
    """The first layer with an attention kernel (a hybrid's others are recurrent), and the static taps there that its
    kernel is handed (the values a trace reads there on the compiled engine)."""
    for layer in range(model.num_layers):
        found = taps(model.family, model.text_config, layer)
        if found:
            return layer, [short for short, where in found.items() if where == "kernel"]
    raise AssertionError(f"{model.family.name}: no layer with an attention kernel")


def traced(model, prompt: str, layer: int, names: list[str]) -> list[list[torch.Tensor]]:
    """The values read on each step, every step's token forced (`allowed_token_ids`): a tiny random model's greedy
    choice is near a tie, which the two engines' roundings in bfloat16 break differently (Qwen 3.5's MoE on a 2-core
    AMD machine: tokens 48 and 32 at step 1, log-probabilities 0.016 apart), and later steps must see the same
    tokens to be compared."""
    attn = model.layers[layer].self_attn
    forced = [model.tokenizer(prompt)["input_ids"][-1]]
    sampling = dict(max_tokens=STEPS, temperature=0.0, ignore_eos=True, allowed_token_ids=forced)
    with torch.no_grad(), model.trace(prompt, **sampling) as tracer:
        saved = list().save()
        for _ in tracer.iter[:STEPS]:
            saved.append([getattr(attn, name).clone() for name in names])
    return saved


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_reads_the_attention_op_under_vllms_defaults(model_type, tmp_path_factory):
    models = pair(model_type, tmp_path_factory)
    layer, shorts = kernel_taps(models.vllm)
    if not shorts:
        with pytest.raises(attnlens.Unavailable, match="not a static tap on vLLM"):
            attnlens.StandardizedVLLM(str(models.path), static_points=[f"query.{layer}"], **models.engine)
        return
    names = [BY_SHORT[short].name for short in shorts]
    compiled = attnlens.StandardizedVLLM(str(models.path), static_points=[f"{shorts[0]}.{layer}"], **models.engine)
    assert compiled.compiled
    got = traced(compiled, models.prompt, layer, names)
    want = traced(models.vllm, models.prompt, layer, names)
    rtol = tolerance(models)
    for step, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(names, mine, theirs, strict=True):
            if name == "attention_scores":  # masked entries: each engine's fill
                visible = ~attnlens.masked(b)
                assert a.shape == b.shape and torch.equal(~attnlens.masked(a), visible), (step, name)
                a, b = a[visible], b[visible]
            assert close(a, b, rtol), (model_type, step, name)
