"""On the device, in each dtype: every family's identities, rebuilt patterns against eager, capture of rows and heads,
rebuilt patterns under generate, and an edit moving the logits as recomputing by hand predicts. Tolerances are
`attnlens.checks.TOLERANCE` per dtype (the identities) and docs/patterns-without-eager.md's (rebuilt vs eager)."""

import pytest
import torch

import attnlens
from attnlens.checks import close, failures, read_everything
from attnlens.models import char_tokenizer, tiny_cases, tiny_model

PROMPT = "Hello world, again"
#: How far a rebuilt pattern may be from an eager model's: the models' earlier layers round differently.
REBUILT_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def on(case, device, dtype, implementation="eager"):
    """The tiny model of `case` on `device` in `dtype` (None where transformers cannot run the implementation)."""
    try:
        inner = tiny_model(case, attn_implementation=implementation).to(device=device, dtype=dtype)
    except ValueError:  # "does not support an attention implementation through ... sdpa"
        return None
    return attnlens.StandardizedTransformer(
        inner,
        tokenizer=char_tokenizer(),
        attn_implementation=implementation,
        rebuild_patterns=implementation != "eager",
    )


def patterned(model):
    return [i for i in range(model.num_layers) if model.support(i)["self_attn.attention_probabilities"] is None]


@pytest.mark.parametrize("case", tiny_cases())
def test_identities_on_the_device(case, device, dtype):
    model = on(case, device, dtype)
    with torch.no_grad():
        saved = read_everything(model, PROMPT)
    assert saved["logits"].device.type == device.type
    assert {layer: failures(model, saved, layer) for layer in range(model.num_layers)} == {
        layer: [] for layer in range(model.num_layers)
    }


@pytest.mark.parametrize("case", tiny_cases())
def test_rebuilt_patterns_capture_and_generation_on_the_device(case, device, dtype):
    eager, sdpa = on(case, device, dtype), on(case, device, dtype, "sdpa")
    if sdpa is None or not patterned(sdpa):
        pytest.skip(f"{case} has no pattern to rebuild under sdpa")
    layers = patterned(sdpa)
    rebuilt = attnlens.capture_attention(sdpa, [PROMPT, PROMPT[:9]], layers, keep="probs")
    real = attnlens.capture_attention(eager, [PROMPT, PROMPT[:9]], layers, keep="probs")
    for got, want in zip(rebuilt, real):
        for layer in layers:
            assert got[layer]["probs"].device.type == device.type
            assert (got[layer]["probs"].float() - want[layer]["probs"].float()).abs().max() <= REBUILT_TOLERANCE[dtype]
    some = attnlens.capture_attention(sdpa, PROMPT, layers[-1], rows=[-1, 3], heads=[1, 0], chunk_rows=2)
    assert close(some[layers[-1]]["probs"], rebuilt[0][layers[-1]]["probs"][[1, 0]][:, [-1, 3]])
    attn = sdpa.layers[layers[-1]].self_attn
    with (
        torch.no_grad(),
        sdpa.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0) as tracer,
    ):
        steps = list().save()
        for _ in tracer.iter[:3]:
            steps.append((attn.attention_probabilities.clone(), attn.attention_key_positions.clone()))
    for probabilities, positions in steps:
        assert probabilities.device.type == device.type and positions.shape[-1] == probabilities.shape[-1]
        assert close(probabilities.sum(-1), torch.ones_like(probabilities[..., 0]))


@pytest.mark.parametrize("case", tiny_cases())
def test_ablating_a_head_moves_the_logits_as_recomputed_by_hand(case, device, dtype):
    model = on(case, device, dtype)
    layer = next(iter(patterned(model)), None)
    if layer is None or model.support(layer)["self_attn.attention_head_outputs"] is not None:
        pytest.skip(f"{case} serves no head outputs on a pattern layer")
    attn = model.layers[layer].self_attn
    with torch.no_grad():
        with model.trace(PROMPT):
            heads = attn.attention_head_outputs.save()
            output = attn.attention_output.save()
            clean = model.logits.save()
        with model.trace(PROMPT):
            attn.attention_head_outputs[:, :, 0] = 0
            ablated = model.logits.save()
        by_hand = heads.clone()
        by_hand[:, :, 0] = 0
        if model.support(layer)["self_attn.attention_gate"] is None:
            pytest.skip(f"{case}'s heads are gated: the premix is not their merge alone")
        premix = model.family.identities.merge_heads(attn._module, by_hand)
        projected = model.family.identities.project_output(attn._module, premix)
        with model.trace(PROMPT):
            attn.attention_output = projected.reshape(output.shape)
            predicted = model.logits.save()
    assert not torch.equal(ablated, clean)
    # the hand path rounds in another order (DeepSeek-V4 rotates each head back): within the dtype's step of the logits
    assert close(ablated / ablated.abs().max(), predicted / ablated.abs().max())
