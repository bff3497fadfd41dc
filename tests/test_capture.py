"""capture_attention, run_with_cache and their helpers on the transformers engine: equal to the trace values, on every
family."""

import pytest
import torch
from conftest import ALL_CASES, PROMPT, tiny

import attnlens
from attnlens.capture import CACHE_NAMES, FUSED

PROMPTS = ["Hello world, again", "Hi", "The cat sat on the mat"]  # lengths 18, 2, 22: padding in every batch


def attention_layer(model, *names):
    """The first layer serving every one of `names` (attention values), or None."""
    for layer in range(model.num_layers):
        if all(model.support(layer)[f"self_attn.{name}"] is None for name in names):
            return layer
    return None


def traced(model, prompt, layer, *names):
    with torch.no_grad(), model.trace(prompt):
        saved = list().save()
        for name in names:
            saved.append(getattr(model.layers[layer].self_attn, name))
    return dict(zip(names, saved))


def in_order(model, layer, names):
    return sorted(names, key=lambda name: model.order(layer)[f"self_attn.{name}"])


def forwards(model):
    """A counter of the model's forward calls, to show a request failed before anything ran."""
    calls = []
    handle = model._module.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls, handle


# --- capture_attention ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES)
def test_capture_and_helpers_equal_the_trace_values(case):
    """On every family: capture_attention is the trace's values; probs @ per_head_value is the head outputs (grouped,
    multi-query, latent attention, sinks); attn_out_gate is the gate where there is one and a refusal elsewhere."""
    model = tiny(case)
    names = ("attention_values", "attention_scores", "attention_probabilities")
    layer = attention_layer(model, *names, "attention_head_outputs")
    assert layer is not None
    gated = model.support(layer)["self_attn.attention_gate"] is None
    names = in_order(model, layer, names + ("attention_head_outputs",) + (("attention_gate",) if gated else ()))
    saved = traced(model, PROMPT, layer, *names)

    out = attnlens.capture_attention(model, PROMPT, [layer])
    assert set(out) == {layer}
    assert torch.equal(out[layer]["value"], saved["attention_values"][0].transpose(0, 1))  # [key, kv_heads, dim]
    assert torch.equal(out[layer]["scores"], saved["attention_scores"][0])  # [heads, query, key]
    assert torch.equal(out[layer]["probs"], saved["attention_probabilities"][0])

    cache = attnlens.run_with_cache(
        model, PROMPT, [f"value.{layer}", f"attn_probs.{layer}"] + ([f"attn_gate.{layer}"] if gated else [])
    )
    value = attnlens.per_head_value(model, cache, layer)
    attn = model.layers[layer].self_attn
    assert value.shape == (1, 18, attn.num_heads, attn.head_dim)
    mixed = torch.einsum("bhqk,bkhd->bqhd", cache.get("attn_probs", layer), value)
    assert torch.allclose(mixed, saved["attention_head_outputs"], atol=1e-5, rtol=1e-4)
    assert attnlens.per_head_value(model, cache, layer, expand=False).shape == (1, 18, attn.num_kv_heads, attn.head_dim)
    if gated:
        gate = attnlens.attn_out_gate(model, cache, layer)
        assert gate.shape == (1, 18, attn.num_heads, attn.head_dim)
        assert torch.equal(gate, saved["attention_gate"])
    else:
        with pytest.raises(attnlens.Unavailable, match=f"the {model.family.name} family has no output gate"):
            attnlens.attn_out_gate(model, cache, layer)


def test_layouts_one_prompt_or_several():
    model = tiny("llama")
    ids = model.tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    one = attnlens.capture_attention(model, PROMPT, [0, 2])
    assert set(one) == {0, 2} and one[2]["probs"].shape == (4, 18, 18) and one[2]["value"].shape == (18, 2, 16)
    assert isinstance(
        attnlens.capture_attention(model, model.tokenizer(PROMPT, return_tensors="pt").input_ids, 0), dict
    )  # [1, seq]: one prompt
    many = attnlens.capture_attention(model, PROMPTS, 1)
    assert [r[1]["probs"].shape[-1] for r in many] == [18, 2, 22]
    from_encoding = attnlens.capture_attention(model, dict(ids), 1)  # padding dropped
    assert [r[1]["probs"].shape[-1] for r in from_encoding] == [18, 2]
    batch = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    assert len(attnlens.capture_attention(model, batch, 1)) == 2  # [batch, seq]: several


def test_keep_heads_and_rows():
    model = tiny("qwen3")
    full = attnlens.capture_attention(model, PROMPTS, [1])
    some = attnlens.capture_attention(model, PROMPTS, [1], keep=["probs"], heads=[3, 0], rows=[-1, 0])
    for whole, part in zip(full, some):
        assert set(part[1]) == {"probs"}
        length = whole[1]["probs"].shape[-1]
        assert torch.allclose(part[1]["probs"], whole[1]["probs"][[3, 0]][:, [length - 1, 0]], atol=1e-6)
    last = attnlens.capture_attention(model, PROMPT, 1, keep="scores", rows=-1)
    assert last[1]["scores"].shape == (4, 1, 18)
    window = attnlens.capture_attention(model, PROMPT, 1, keep="probs", rows=slice(2, 5), heads=1)
    assert torch.equal(window[1]["probs"], full[0][1]["probs"][[1], 2:5])
    with pytest.raises(IndexError):
        attnlens.capture_attention(model, "Hi", 1, rows=[5])
    with pytest.raises(IndexError):
        attnlens.capture_attention(model, "Hi", 1, heads=[4])
    with pytest.raises(ValueError, match=r"keep names some of .*; got \['pattern'\]"):
        attnlens.capture_attention(model, "Hi", 1, keep=["pattern"])


@pytest.mark.parametrize("case", ALL_CASES + attnlens.models.tiny_cases(causal=False))
def test_padded_batches_equal_one_prompt_at_a_time(case):
    """Every family: left padding with mask-derived positions (grouped heads, learned positions, sliding windows
    shorter than the prompts, recurrences that skip the padding), and an encoder's right padding (its positions its
    own, each prompt at the start of its row); families whose values padding would change
    (`Family.padding_changes_values`: TrOCR, RecurrentGemma) batch only prompts of one length."""
    model = tiny(case)
    layers = [
        layer for layer in range(model.num_layers) if model.support(layer)["self_attn.attention_probabilities"] is None
    ]
    if not layers:
        pytest.skip(f"{case} serves no pattern")
    batched = attnlens.capture_attention(model, PROMPTS, layers, batch_size=3)
    for prompt, together in zip(PROMPTS, batched):
        alone = attnlens.capture_attention(model, prompt, layers)
        for layer in alone:
            for kind in ("scores", "probs", "value"):
                assert together[layer][kind].shape == alone[layer][kind].shape
                assert _close(together[layer][kind], alone[layer][kind]), (layer, kind)


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: float = 1e-4) -> bool:
    """Masked entries (the dtype's lowest, or -inf) where `b` has them, the rest within `tolerance` of the largest
    entry: a recurrence run beside left padding moves values by float32 rounding (Qwen3.5's Gated DeltaNet on the
    released checkpoint's weights: 1.6e-5 of the largest score)."""
    masked = b <= torch.finfo(b.dtype).min
    if not torch.equal(a <= torch.finfo(a.dtype).min, masked):
        return False
    return bool((a - b).abs()[~masked].max() <= tolerance * b[~masked].abs().max())


def test_padded_caches_equal_one_prompt_at_a_time():
    model = tiny("gpt2")
    names = ["resid_post.2", "logits", "attn_probs.1", "z.1"]
    for prompt, cache in zip(PROMPTS, attnlens.run_with_cache(model, PROMPTS, names, batch_size=3)):
        alone = attnlens.run_with_cache(model, prompt, names)
        for key in alone:
            assert torch.allclose(cache[key], alone[key], atol=1e-5, rtol=1e-4), key


def test_unavailable_requests_fail_before_the_model_runs():
    model = attnlens.models.tiny("llama", attn_implementation="sdpa")
    calls, handle = forwards(model)
    try:
        with pytest.raises(attnlens.Unavailable) as error:
            attnlens.capture_attention(model, PROMPT, [1])
        assert model.support(1)["self_attn.attention_scores"] in str(error.value)
        assert calls == []
    finally:
        handle.remove()


def test_results_written_to_disk(tmp_path):
    model = tiny("llama")
    stored = attnlens.capture_attention(model, PROMPTS, [1], rows=-1, save_to=tmp_path / "capture", batch_size=2)
    in_memory = attnlens.capture_attention(model, PROMPTS, [1], rows=-1, batch_size=2)
    assert len(stored) == 3 and sorted(p.name for p in (tmp_path / "capture").iterdir()) == [
        "000000.safetensors",
        "000001.safetensors",
        "000002.safetensors",
    ]
    for on_disk, held in zip(stored, in_memory):
        assert all(torch.equal(on_disk[1][kind], held[1][kind]) for kind in held[1])
    caches = attnlens.run_with_cache(model, PROMPTS, ["attn_probs.1", "logits"], save_to=tmp_path / "cache")
    assert torch.equal(
        caches[2].get("attn_probs", 1),
        attnlens.run_with_cache(model, PROMPTS[2], ["attn_probs.1"]).get("attn_probs", 1),
    )


def test_a_progress_bar_on_long_runs(capsys):
    model = tiny("llama")
    attnlens.capture_attention(model, PROMPTS, [1], keep="probs", batch_size=1)
    assert "attnlens capture" in capsys.readouterr().err
    attnlens.capture_attention(model, PROMPTS, [1], keep="probs", batch_size=8)  # one batch: no bar
    assert "attnlens capture" not in capsys.readouterr().err


# --- run_with_cache ---------------------------------------------------------------------------------------------------


def test_every_standardized_value_has_one_cache_name():
    assert set(CACHE_NAMES) == {value.name for value in attnlens.ALL_VALUES}
    assert len(set(CACHE_NAMES.values()) | {FUSED}) == len(CACHE_NAMES) + 1
    assert (CACHE_NAMES["attention_probabilities"], CACHE_NAMES["attention_values"], CACHE_NAMES["attention_gate"]) == (
        "attn_probs",
        "value",
        "attn_gate",
    )


def test_run_with_cache_equals_the_trace_values():
    model = tiny("gemma2")
    names = [
        "embed",
        "resid_pre.1",
        "query.1",
        "key.1",
        "value.1",
        "attn_scores.1",
        "attn_probs.1",
        "z.1",
        "premix.1",
        "attn_out.1",
        "resid_mid.1",
        "mlp_act.1",
        "mlp_out.1",
        "resid_post.1",
        "logits",
    ]
    cache = attnlens.run_with_cache(model, PROMPT, reversed(names))  # any order: read in forward order
    layer, attn = model.layers[1], model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        expected = list().save()
        expected += [
            model.embeddings,
            layer.layer_input,
            attn.attention_queries,
            attn.attention_keys,
            attn.attention_values,
            attn.attention_scores,
            attn.attention_probabilities,
            attn.attention_head_outputs,
            attn.attention_premix,
            attn.attention_output,
            layer.layer_mid,
            layer.mlp.mlp_activation,
            layer.mlp.mlp_output,
            layer.layer_output,
            model.logits,
        ]
    for name, value in zip(names, expected):
        assert torch.equal(cache[name], value), name
    assert torch.equal(cache.get("attn_probs", 1), cache.get("attention_probabilities", 1))  # standardized names too
    assert "attn_probs.1" in cache and "attn_probs.2" not in cache
    with pytest.raises(KeyError, match="was not captured"):
        cache.get("attn_probs", 2)


def test_a_batch_tensor_gives_one_cache_and_a_list_one_per_prompt():
    model = tiny("llama")
    batch = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    cache = attnlens.run_with_cache(model, batch, ["attn_probs.0"])
    assert cache.get("attn_probs", 0).shape == (2, 4, 6, 6)
    caches = attnlens.run_with_cache(model, PROMPTS, ["attn_probs.0"])
    assert [c.get("attn_probs", 0).shape for c in caches] == [(1, 4, n, n) for n in (18, 2, 22)]


def test_unknown_and_unavailable_names_fail_before_the_model_runs():
    model = tiny("llama")
    calls, handle = forwards(model)
    try:
        with pytest.raises(KeyError, match="not a cache name"):
            attnlens.run_with_cache(model, PROMPT, ["attn_pattern.1"])
        with pytest.raises(KeyError, match="name a layer"):
            attnlens.run_with_cache(model, PROMPT, ["attn_probs"])
        with pytest.raises(KeyError, match="model value"):
            attnlens.run_with_cache(model, PROMPT, ["logits.3"])
        with pytest.raises(IndexError):
            attnlens.run_with_cache(model, PROMPT, ["attn_probs.7"])
        with pytest.raises(attnlens.Unavailable) as error:
            attnlens.run_with_cache(model, PROMPT, ["attn_probs.1", "attn_gate.1"])
        assert model.support(1)["self_attn.attention_gate"] in str(error.value)
        with pytest.raises(attnlens.Unavailable, match="separate query, key and value projections"):
            attnlens.run_with_cache(model, PROMPT, ["qkv.1"])
        assert calls == []
    finally:
        handle.remove()


# --- helpers ----------------------------------------------------------------------------------------------------------


def test_gated_families_are_found():
    assert all(attention_layer(tiny(case), "attention_gate") is not None for case in ("qwen3_next", "qwen3_5_text"))


def test_the_gate_completes_the_head_outputs():
    """On a gated family z * gate, merged, is the premix: DFA from probs @ value alone is off by the gate."""
    model = tiny("qwen3_next")
    layer = attention_layer(model, "attention_gate")
    cache = attnlens.run_with_cache(
        model, PROMPT, [f"value.{layer}", f"attn_probs.{layer}", f"attn_gate.{layer}", f"premix.{layer}"]
    )
    z = torch.einsum("bhqk,bkhd->bqhd", cache.get("attn_probs", layer), attnlens.per_head_value(model, cache, layer))
    gated = z * attnlens.attn_out_gate(model, cache, layer)
    assert torch.allclose(gated.flatten(-2), cache.get("premix", layer), atol=1e-5)
    assert not torch.allclose(z.flatten(-2), cache.get("premix", layer), atol=1e-3)


FUSED_CASES = [case for case in ALL_CASES if attnlens.family_for(case.split(":")[0]).fused_qkv is not None]


def test_fused_families_are_found():
    assert {
        "gpt2",
        "gpt_bigcode",
        "gpt_bigcode:multi_head",
        "gpt_neox",
        "phi3",
        "bloom",
        "falcon",
        "falcon:alibi",
        "falcon:multihead",
        "falcon:new_architecture",
        "mpt",
    } <= set(FUSED_CASES)


def _rotary(model):
    return any("rotary" in name for name, _ in model._module.named_modules())


@pytest.mark.parametrize("case", FUSED_CASES)
def test_split_fused_qkv_with_the_family_layout(case):
    model = tiny(case)
    layer = attention_layer(model, "attention_queries", "attention_keys", "attention_values")
    names = [f"qkv.{layer}", f"query.{layer}", f"key.{layer}", f"value.{layer}"]
    cache = attnlens.run_with_cache(model, PROMPT, names)
    split = attnlens.split_fused_qkv(model, cache.get("qkv", layer), layer)
    attn = model.layers[layer].self_attn
    assert split["q"].shape == (1, 18, attn.num_heads, attn.head_dim)
    assert split["k"].shape == split["v"].shape == (1, 18, attn.num_kv_heads, attn.head_dim)
    # values have no rotary embedding or norm: the split is what attention receives
    assert torch.equal(split["v"].transpose(1, 2), cache.get("value", layer))
    if not _rotary(model):
        assert torch.equal(split["k"].transpose(1, 2), cache.get("key", layer))
        assert torch.equal(split["q"].transpose(1, 2), cache.get("query", layer))


def test_split_fused_qkv_refuses_what_does_not_match():
    gpt2 = tiny("gpt2")
    cache = attnlens.run_with_cache(gpt2, PROMPT, ["qkv.1", "value.1"])
    with pytest.raises(ValueError, match=r"last axis is 192 wide"):
        attnlens.split_fused_qkv(gpt2, cache.get("value", 1))  # already split per head
    with pytest.raises(ValueError, match="last axis"):
        attnlens.split_fused_qkv(gpt2, cache.get("qkv", 1)[..., :-16])  # truncated
    with pytest.raises(attnlens.Unavailable, match="nothing is fused"):
        attnlens.split_fused_qkv(tiny("llama"), cache.get("qkv", 1))
    # one width, two layouts: the same tensor splits differently on a per-head family
    neox = attnlens.split_fused_qkv(tiny("gpt_neox"), cache.get("qkv", 1))
    blocks = attnlens.split_fused_qkv(gpt2, cache.get("qkv", 1))
    assert not torch.equal(neox["v"], blocks["v"])
