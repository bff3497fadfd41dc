"""`attnlens.collect`: corpus features equal head_summaries and capture_attention, the output is one table in every
reader, a killed run restarts exactly once, bad prompts go to the errors table, other runs' folders are refused."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny

import attnlens
from attnlens import heads
from attnlens.collect import CollectMismatch, Corpus, Feature, read_table, store
from attnlens.collect import features as registry

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it)
pytestmark = pytest.mark.any_transformers

PROMPTS = ["Hello world, again", "Hi", "The cat sat on the mat", "x", "A longer prompt, past the windows of four"]
ROWS = [-1, 0, 2]
SPANS = [[0, 1], [1, -1], [-3, None]]  # span_mass's token ranges, as Python slices them
CONTEXT = -2  # lookback: every token but the last two is the context
TOLERANCE = dict(atol=2e-5, rtol=1e-5)  # float32 sums over up to 40 rows, as test_heads


def write_jsonl(path, items):
    with open(path, "w", encoding="utf-8") as file:
        for item in items:
            file.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def by_prompt(table):
    """{(prompt, layer, head): row} of a collected table, refusing duplicates."""
    rows = table.to_pylist()
    found = {(r["prompt"], r["layer"], r["head"]): r for r in rows}
    assert len(found) == len(rows), "a (prompt, layer, head) row is there twice"
    return found


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    return write_jsonl(folder / "corpus.jsonl", [{"id": f"p{i}", "text": t} for i, t in enumerate(PROMPTS)])


@pytest.mark.parametrize("case", ["llama", "gemma3", "gpt2"])
def test_collected_features_equal_head_summaries_and_capture(case, corpus, tmp_path):
    """Every feature, on families with grouped heads, sliding windows and a LayerNorm block, batched with left
    padding (batch_size 3 over prompts of 1 to 41 tokens), equals the eager engine's own functions on the prompts."""
    model = tiny(case)
    result = attnlens.collect(
        model, corpus, "all", tmp_path / "out", rows=ROWS, top_k=3, batch_size=3, shard_size=2, progress=False,
        spans=SPANS, context=CONTEXT,
    )  # fmt: skip
    layers = result.layers
    heads_of = model.access.geometry(layers[0]).num_heads
    assert result.rows == len(PROMPTS) * len(layers) * heads_of and result.errors == 0 and result.shards == 3
    table = by_prompt(read_table(tmp_path / "out"))
    ids = [model.tokenizer(t)["input_ids"] for t in PROMPTS]

    # entropy and sink: head_summaries over the same prompts is the token-weighted mean of the per-prompt means
    summaries = attnlens.head_summaries(
        model, PROMPTS, layers, length=4, sequences=1, top_k=3, rows=[-1], progress=False
    )
    for layer in layers:
        for metric in ("entropy", "sink"):
            got = torch.tensor(
                [sum(table[p, layer, h][metric] * len(ids[p]) for p in range(len(PROMPTS))) for h in range(heads_of)]
            ) / sum(map(len, ids))
            assert torch.allclose(got, summaries.get(metric, layer), **TOLERANCE), (metric, layer)
        for p, entry in enumerate(summaries.top[layer]):  # the last row's top keys, as head_summaries lists them
            row = table[p, layer, 0]
            last = row["top_rows"].index(len(ids[p]) - 1)
            for h, listed in enumerate(entry["keys"]):
                found = table[p, layer, h]
                keys = [k for k, w in zip(found["top_keys"][last], found["top_weights"][last]) if k >= 0 and w > 0]
                assert keys == [position for position, _, _ in listed], (layer, p, h)

    # the pattern rows, the previous-token weight and top weights from capture_attention's full eager patterns
    captured = attnlens.capture_attention(model, PROMPTS, layers, keep="probs", progress=False)
    cache = attnlens.run_with_cache(
        model, PROMPTS, [f"{n}.{layer}" for layer in layers for n in ("query", "key", "value", "z")], progress=False
    )
    for p, n in enumerate(map(len, ids)):
        rows = sorted({r % n for r in ROWS if -n <= r < n})
        for layer in layers:
            probs = captured[p][layer]["probs"]
            group = model.access.geometry(layer).num_heads // model.access.geometry(layer).num_kv_heads
            for h in range(heads_of):
                row = table[p, layer, h]
                assert row["pattern_rows"] == rows == row["top_rows"] and row["tokens"] == n
                assert row["span_rows"] == rows == row["lookback_rows"]
                context = len(range(n)[:CONTEXT])
                for j, r in enumerate(rows):
                    assert torch.allclose(torch.tensor(row["pattern"][j]), probs[h, r, : r + 1], **TOLERANCE)
                    masses = [float(probs[h, r, :n][start:end].sum()) for start, end in SPANS]  # 0 past row r
                    assert row["span_mass"][j] == pytest.approx(masses, abs=2e-5), (layer, p, h, r)
                    later = r + 1 - context
                    if later > 0 and context:
                        on_context = float(probs[h, r, :context].sum()) / context
                        on_later = float(probs[h, r, context : r + 1].sum()) / later
                        assert row["lookback"][j] == pytest.approx(on_context / (on_context + on_later), abs=2e-5)
                    else:  # the row sees no token past the context, or there is no context: nan
                        assert row["lookback"][j] != row["lookback"][j]
                    weights, keys = probs[h, r, : r + 1].topk(min(3, r + 1))
                    assert torch.allclose(torch.tensor(row["top_weights"][j][: len(weights)]), weights, **TOLERANCE)
                previous = probs[h, 1:, :].diagonal().mean() if n > 1 else torch.tensor(float("nan"))
                assert torch.allclose(torch.tensor(row["previous"]), previous, equal_nan=True, **TOLERANCE)
                norms = {
                    "query_norm": cache[p][f"query.{layer}"][0, h],
                    "key_norm": cache[p][f"key.{layer}"][0, h // group],
                    "value_norm": cache[p][f"value.{layer}"][0, h // group],
                    "head_output_norm": cache[p][f"z.{layer}"][0, :, h],
                }
                for column, values in norms.items():
                    assert abs(row[column] - float(values.norm(dim=-1).mean())) < 1e-4, (column, p, layer, h)
                assert row["kv_head"] == h // group
    assert table[0, layers[0], 0]["key"] == "p0"


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_top_keys_alone_score_only_the_chosen_rows_and_equal_the_whole(case, corpus, tmp_path, monkeypatch):
    """Collected with no feature that sums over every row, the top keys score only the chosen rows, one at a time
    against the keys each sees (sliding windows included), and equal those of a collection that scores every row."""
    model = tiny(case)
    options = dict(rows=ROWS, top_k=3, batch_size=3, progress=False)
    whole = attnlens.collect(model, corpus, ["entropy", "top_keys"], tmp_path / "whole", **options)
    scored = []
    summarize = heads.summarize

    def counted(scores, queries, keys, **kwargs):
        scored.append(queries.shape[2])
        return summarize(scores, queries, keys, **kwargs)

    monkeypatch.setattr(heads, "summarize", counted)
    alone = by_prompt(read_table(attnlens.collect(model, corpus, ["top_keys"], tmp_path / "alone", **options).out))
    assert set(scored) == {1}, "top keys alone scored more than their rows"
    whole = by_prompt(read_table(whole.out))
    assert alone.keys() == whole.keys()
    for key, row in alone.items():
        assert row["top_rows"] == whole[key]["top_rows"] and row["top_keys"] == whole[key]["top_keys"], key
        assert torch.allclose(torch.tensor(row["top_weights"]), torch.tensor(whole[key]["top_weights"]), **TOLERANCE)


def test_the_output_is_one_table_in_every_reader(corpus, tmp_path):
    model = tiny("llama")
    out = tmp_path / "out"
    attnlens.collect(model, corpus, ["sink", "top_keys", "key_norm"], out, shard_size=2, progress=False)
    shards = sorted((out / "data").glob("*.parquet"))
    assert len(shards) == 3
    meta = json.loads(pq.read_schema(shards[0]).metadata[b"attnlens"])
    assert {"model", "family", "attnlens_version", "config_hash", "features_hash", "engine", "dtype"} <= set(meta)
    assert meta["family"] == "Llama" and meta["engine"] == "transformers" and meta["dtype"] == "float32"
    assert meta["covers"] == [[0, 2]]

    table = read_table(out)
    expected = len(PROMPTS) * 3 * 4
    assert table.num_rows == expected and sorted(set(table["prompt"].to_pylist())) == list(range(len(PROMPTS)))
    assert pq.read_table(out / "data").num_rows == expected  # a folder read as a dataset: temporaries are hidden
    import duckdb
    import pandas
    import polars

    sql = (
        f"SELECT layer, head, avg(sink) AS sink, count(*) AS n FROM read_parquet('{out}/data/*.parquet') "
        f"GROUP BY layer, head ORDER BY layer, head"
    )
    by_duckdb = duckdb.sql(sql).df()
    by_pandas = pandas.read_parquet(out / "data").groupby(["layer", "head"])["sink"].mean()
    assert len(by_duckdb) == 12 and (by_duckdb["n"] == len(PROMPTS)).all()
    assert torch.allclose(torch.tensor(by_duckdb["sink"].tolist()), torch.tensor(by_pandas.tolist()), atol=1e-6)
    assert polars.read_parquet(out / "data" / "*.parquet").height == expected
    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset(
        "parquet", data_files=str(out / "data" / "*.parquet"), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert len(loaded) == expected and loaded[0]["top_keys"] is not None


def test_bad_prompts_go_to_the_errors_table_and_never_stop_the_run(tmp_path):
    model = tiny("llama")  # 128 positions
    path = tmp_path / "mixed.jsonl"
    write_jsonl(
        path,
        [
            {"text": "fine"},
            {"text": ""},
            {"text": "y" * 300},
            "{not json",
            {"title": "no text"},
            {"text": 12},
            {"text": [1, 5, 9]},
            {"text": [1, 999]},
            {"text": "fine again", "id": 7},
        ],
    )
    with open(path, "ab") as file:
        file.write(b'{"text": "bad \xff byte"}\n')
    result = attnlens.collect(model, path, ["sink"], tmp_path / "out", shard_size=4, progress=False)
    errors = read_table(tmp_path / "out", "errors").to_pylist()
    reasons = {e["prompt"]: (e["reason"], e["detail"]) for e in errors}
    assert set(reasons) == {1, 2, 3, 4, 5, 7, 9} and result.errors == 7 and result.prompts == 10
    assert reasons[1][0] == "empty"
    assert reasons[2] == ("too_long", "300 tokens; the engine's context takes 128")
    assert reasons[3][0] == reasons[4][0] == reasons[5][0] == reasons[7][0] == reasons[9][0] == "undecodable"
    assert "not JSON" in reasons[3][1] and "no field 'text'" in reasons[4][1] and "holds int" in reasons[5][1]
    assert "outside the vocabulary" in reasons[7][1] and "not valid UTF-8" in reasons[9][1]
    data = read_table(tmp_path / "out")
    assert sorted(set(data["prompt"].to_pylist())) == [0, 6, 8]  # token ids (6) run as given
    assert data.filter(pa.compute.equal(data["prompt"], 8))["key"][0].as_py() == "7"

    # a prompt the forward itself fails on: retried alone, recorded, and the rest of its batch still runs
    def fragile(context):
        if context.tokens == len(model.tokenizer("fine again")["input_ids"]):
            raise RuntimeError("this prompt breaks the feature")
        return {"fragile": context.values["attention_queries"].new_zeros(context.values["attention_queries"].shape[1])}

    registry.register(
        Feature("fragile", "fails on one length", ("attention_queries",), {"fragile": "float32"}, fragile)
    )
    try:
        result = attnlens.collect(model, path, ["fragile"], tmp_path / "fragile", progress=False)
    finally:
        del registry.FEATURES["fragile"]
    failed = [e for e in read_table(tmp_path / "fragile", "errors").to_pylist() if e["reason"] == "failed"]
    assert [e["prompt"] for e in failed] == [8]
    assert "RuntimeError: this prompt breaks the feature" in failed[0]["detail"]
    assert sorted(set(read_table(tmp_path / "fragile")["prompt"].to_pylist())) == [0, 6]


def test_text_parquet_and_dataset_corpora_stream_the_same_prompts(tmp_path):
    model = tiny("llama")
    (tmp_path / "c.txt").write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    pq.write_table(
        pa.table({"text": PROMPTS, "id": [f"p{i}" for i in range(len(PROMPTS))]}),
        tmp_path / "c.parquet",
        row_group_size=2,
    )
    datasets = pytest.importorskip("datasets")
    sources = {
        "txt": tmp_path / "c.txt",
        "parquet": tmp_path / "c.parquet",
        "dataset": datasets.Dataset.from_dict({"text": PROMPTS}),
    }
    for name, source in sources.items():
        records = list(Corpus(source))
        assert [r.text for r in records] == PROMPTS and len(Corpus(source)) == len(PROMPTS), name
    tables = {
        name: read_table(attnlens.collect(model, source, ["entropy"], tmp_path / name, progress=False).out)
        for name, source in sources.items()
    }
    want = tables["txt"].sort_by([("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending")])
    for name, table in tables.items():
        got = table.sort_by([("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending")])
        assert got["entropy"].to_pylist() == want["entropy"].to_pylist(), name
    assert tables["parquet"]["key"][0].as_py() == "p0"
    with pytest.raises(ValueError, match="no column 'body'"):
        Corpus(tmp_path / "c.parquet", field="body")
    with pytest.raises(ValueError, match="cannot tell its format"):
        (tmp_path / "c.csv").write_text("a\n")
        Corpus(tmp_path / "c.csv")


def test_a_folder_of_another_run_is_refused(corpus, tmp_path):
    out = tmp_path / "out"
    attnlens.collect(tiny("llama"), corpus, ["sink", "entropy"], out, progress=False)
    again = attnlens.collect(tiny("llama"), corpus, ["entropy", "sink"], out, progress=False)  # same set: continued
    assert again.prompts == 0 and again.already_done == len(PROMPTS)
    with pytest.raises(
        CollectMismatch,
        match=r"features: \['entropy', 'sink'\] there, \['entropy', 'sink', "
        r"'previous'\] now",
    ):
        attnlens.collect(tiny("llama"), corpus, ["sink", "entropy", "previous"], out, progress=False)
    with pytest.raises(CollectMismatch, match="family: 'Llama' there, 'GPT2' now"):
        attnlens.collect(tiny("gpt2"), corpus, ["sink", "entropy"], out, progress=False)
    with pytest.raises(CollectMismatch, match="features_hash"):
        attnlens.collect(tiny("llama"), corpus, ["sink", "entropy"], out, layers=[0], progress=False)
    with pytest.raises(CollectMismatch, match="corpus: "):
        attnlens.collect(
            tiny("llama"), write_jsonl(tmp_path / "other.jsonl", ["{}"]), ["sink", "entropy"], out, progress=False
        )
    with pytest.raises(CollectMismatch, match="config_hash"):
        attnlens.collect(tiny("llama", num_attention_heads=8), corpus, ["sink", "entropy"], out, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(CollectMismatch, match="not an attnlens collection"):
        attnlens.collect(tiny("llama"), corpus, ["sink"], tmp_path / "other", progress=False)


@pytest.mark.parametrize("crash_at", range(4))
def test_a_crash_at_any_step_of_a_commit_restarts_exactly_once(crash_at, corpus, tmp_path, monkeypatch):
    """A commit writes the errors shard, then the data shard (temporary file, fsync, rename, fsync of the folder).
    Killed before or after each rename, the next run removes what was half done and repeats only that window."""
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in [*PROMPTS, "", *PROMPTS]])  # an error in window 1
    out = tmp_path / "out"
    model = tiny("llama")
    calls = {"n": 0}
    replace = os.replace
    # renames: 0 collect.json, 1 window 0's data shard, 2 window 1's errors shard, 3 window 1's data shard
    target, before = 2 + crash_at // 2, crash_at % 2 == 0

    def crashing(src, dst):
        n = calls["n"]
        calls["n"] += 1
        if n == target and before:
            raise KeyboardInterrupt("killed before the rename")
        replace(src, dst)
        if n == target:
            raise KeyboardInterrupt("killed after the rename")

    monkeypatch.setattr(store.os, "replace", crashing)
    with pytest.raises(KeyboardInterrupt):
        attnlens.collect(model, path, ["sink"], out, shard_size=5, progress=False)  # call 0: collect.json
    monkeypatch.setattr(store.os, "replace", replace)
    result = attnlens.collect(model, path, ["sink"], out, shard_size=5, progress=False)
    assert not list(out.rglob(".*.tmp"))
    assert_exactly_once(out, 11, errors=[5])
    assert result.already_done + result.prompts == 11


def assert_exactly_once(out, count, errors):
    data = read_table(out)
    keys = list(zip(data["prompt"].to_pylist(), data["layer"].to_pylist(), data["head"].to_pylist()))
    assert len(keys) == len(set(keys)), "duplicate rows"
    failed = read_table(out, "errors")["prompt"].to_pylist()
    assert sorted(failed) == errors, failed
    assert sorted({p for p, _, _ in keys} | set(failed)) == list(range(count))
    per_prompt = {p: sum(1 for q, _, _ in keys if q == p) for p in {p for p, _, _ in keys}}
    assert set(per_prompt.values()) == {12}  # 3 layers x 4 heads each


def test_a_run_killed_midway_restarts_with_every_prompt_exactly_once(tmp_path):
    """A real `attnlens collect` process is killed with SIGKILL once its first shards are committed; the same
    command, run again, finishes with every prompt once (data or errors), no torn shard and no temporary file."""
    texts = [f"prompt number {i} " + "abc " * (i % 7) for i in range(160)]
    texts[17] = ""  # one error
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "attnlens",
        "collect",
        "tiny:llama",
        str(path),
        "--features",
        "sink,previous",
        "--out",
        str(out),
        "--shard-size",
        "8",
        "--batch-size",
        "4",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while len(list((out / "data").glob("part-*.parquet"))) < 2 and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before it could be killed; give it more prompts"
    process.send_signal(signal.SIGKILL)
    process.wait()
    committed = sorted((out / "data").glob("part-*.parquet"))
    assert 2 <= len(committed) < 30
    for shard in committed:  # whole shards only: each opens
        pq.read_table(shard)
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr
    assert f"{len(texts)} in the folder" in finished.stdout
    assert not list(out.rglob(".*.tmp"))
    assert_exactly_once(out, len(texts), errors=[17])


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_head_attribution_equals_attnlens_attribution(case, corpus, tmp_path):
    """Per head, the collected direct contribution to the next token's logit (the observed next token; the greedy
    prediction on the last row), batched with left padding, equals `attnlens.attribution`'s head pieces summed over
    sources for that prompt, row and token (Gemma 3: through its norm after attention, frozen at the run)."""
    model = tiny(case)
    result = attnlens.collect(
        model, corpus, ["head_attribution"], tmp_path / "out", rows=ROWS, batch_size=3, progress=False
    )
    table = by_prompt(read_table(result.out))
    heads_of = model.access.geometry(result.layers[0]).num_heads
    for p, text in enumerate(PROMPTS):
        ids = model.tokenizer(text)["input_ids"]
        first = table[p, result.layers[0], 0]
        assert first["attribution_rows"] == sorted({r % len(ids) for r in ROWS if -len(ids) <= r < len(ids)})
        with torch.no_grad():
            predicted = int(model._module(torch.tensor([ids])).logits[0, -1].argmax())
        for j, (row, token) in enumerate(zip(first["attribution_rows"], first["attribution_tokens"])):
            assert token == (ids[row + 1] if row + 1 < len(ids) else predicted)
            want = attnlens.attribution(model, torch.tensor([ids]), rows=row, target=token).by_head()
            for layer in result.layers:
                got = torch.tensor([table[p, layer, h]["attribution"][j] for h in range(heads_of)])
                assert torch.allclose(got, want[layer][0], atol=1e-5, rtol=1e-4), (p, row, layer)


def test_the_registry_is_open(corpus, tmp_path):
    """A feature registered from outside is computed like the built-in ones, from the values it names."""

    def max_weight(context):  # the largest weight of the last row, per head, from the shared summary
        return {"max_weight": context.summary()["top_weights"][0, :, -1, 0]}

    with pytest.raises(ValueError, match="taken"):
        registry.register(Feature("sink2", "a clash", ("attention_queries",), {"sink": "float32"}, max_weight))
    registry.register(
        Feature(
            "max_weight",
            "largest weight of the last row",
            registry.QK,
            {"max_weight": "float32"},
            max_weight,
            scored=True,
        )
    )
    try:
        with pytest.raises(ValueError, match="already"):
            registry.register(registry.FEATURES["max_weight"])
        result = attnlens.collect(
            tiny("llama"), corpus, ["top_keys", "max_weight"], tmp_path / "out", top_k=2, progress=False
        )
        for row in read_table(result.out).to_pylist():
            assert row["max_weight"] == pytest.approx(row["top_weights"][-1][0])
    finally:
        del registry.FEATURES["max_weight"]
    with pytest.raises(ValueError, match=r"unknown feature.*known: entropy"):
        attnlens.collect(tiny("llama"), corpus, ["nope"], tmp_path / "x", progress=False)


def test_layers_that_cannot_serve_a_feature_are_skipped_or_refused(corpus, tmp_path):
    hybrid = tiny("qwen3_next")  # layer 0: linear attention, no queries and keys
    result = attnlens.collect(hybrid, corpus, ["sink"], tmp_path / "out", progress=False)
    assert 0 in result.skipped and 0 not in result.layers and result.layers
    with pytest.raises(attnlens.Unavailable, match="layer 0 on Qwen3Next"):
        attnlens.collect(hybrid, corpus, ["sink"], tmp_path / "out2", layers=[0], progress=False)


def test_the_command_line_refuses_bad_input_in_one_line(corpus, tmp_path, capsys):
    from attnlens.cli import main

    for args, message in (
        (["tiny:llama", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")], "no such file"),
        (["tiny:llama", str(corpus), "--out", str(tmp_path / "o"), "--features", "nope"], "unknown feature"),
        (["tiny:nosuch", str(corpus), "--out", str(tmp_path / "o")], "no tiny model"),
        (["tiny:llama", str(corpus), "--out", str(tmp_path / "o"), "--engine-arg", "dtype"], "write KEY=VALUE"),
    ):
        assert main(["collect", *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("attnlens collect: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert (
        main(
            [
                "collect",
                "tiny:llama",
                str(corpus),
                "--out",
                str(tmp_path / "o"),
                "--features",
                "sink",
                "--engine-arg",
                "dtype=float32",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"{len(PROMPTS)} this run" in printed and "prompts/s" in printed and "tokens/s" in printed


def test_the_docs_list_every_feature_and_its_columns():
    page = (Path(__file__).resolve().parent.parent / "docs" / "corpus.md").read_text()
    for name, feature in registry.FEATURES.items():
        listed = f"| `{name}` | " + ", ".join(f"`{column}`" for column in feature.columns) + " |"
        assert listed in page, listed


def test_a_fault_of_the_code_stops_the_run_rather_than_failing_every_prompt(tmp_path, monkeypatch):
    """A missing module or name is no prompt's doing: raised, not written to the errors table prompt by prompt."""
    from attnlens.collect import collector

    corpus = tmp_path / "c.txt"
    corpus.write_text("Hello world, again\nAnother prompt here\n")

    def broken(self, prompts):
        raise ModuleNotFoundError("No module named 'attnlens.nowhere'")

    monkeypatch.setattr(collector.Collector, "_forward", broken)
    with pytest.raises(ModuleNotFoundError, match=r"attnlens\.nowhere"):
        attnlens.collect(tiny("llama"), corpus, ["sink"], tmp_path / "out", progress=False)
