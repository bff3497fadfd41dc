"""The loop: stream the corpus, skip what is committed, compute a window's features, commit it as one shard.

Windows are computed by a `Collector` (collector.py) in this process, or by one in each Ray worker (ray_pool.py);
only this loop, in the driver, writes the store, so the commit protocol (store.py) is the same either way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Unavailable
from ..family import engine_named
from .collector import Collector, load
from .corpus import Corpus, Record
from .store import Store

DEFAULT_FEATURES = ("entropy", "sink", "previous", "top_keys")


# --- the run ------------------------------------------------------------------------------------------------------


@dataclass
class CollectResult:
    """What a run did: this run's prompts, rows and errors, what earlier runs had committed, time and throughput."""

    out: Path
    prompts: int
    rows: int
    errors: int
    tokens: int
    seconds: float
    already_done: int
    total: int
    shards: int
    layers: list[int] = field(default_factory=list)
    skipped: dict = field(default_factory=dict)

    @property
    def prompts_per_second(self) -> float:
        return self.prompts / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def table(self):
        """The whole collection as one pyarrow Table."""
        from .store import read_table

        return read_table(self.out)

    def errors_table(self):
        from .store import read_table

        return read_table(self.out, "errors")

    def summary(self) -> str:
        earlier = f"; {self.already_done} committed before" if self.already_done else ""
        return (
            f"collected {self.prompts} prompts ({self.rows} rows, {self.errors} errors) in {self.seconds:.1f} s: "
            f"{self.prompts_per_second:.1f} prompts/s, {self.tokens_per_second:.0f} tokens/s; {self.total} of "
            f"the corpus done{earlier}; {self.shards} shards in {self.out}"
        )

    __str__ = summary


def _progress(show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class Rates(ProgressColumn):
        def render(self, task):
            elapsed = task.elapsed or 0.0
            if not elapsed:
                return Text("")
            done = task.completed - task.fields.get("first", 0)
            return Text(
                f"{done / elapsed:.1f} prompts/s {task.fields.get('tokens', 0) / elapsed:,.0f} tokens/s", no_wrap=True
            )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=20),
        MofNCompleteColumn(),
        Rates(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not show,
    )


def windows(corpus: Corpus, done, size: int, limit: int | None = None):
    """Windows of up to `size` records not yet committed, in corpus order (at most `limit` records in all)."""
    window: list[Record] = []
    taken = 0
    for record in corpus:
        if record.index in done:
            continue
        if limit is not None and taken >= limit:
            break
        window.append(record)
        taken += 1
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def collect(
    model: Any,
    corpus: Any,
    features: Sequence[str] | str = DEFAULT_FEATURES,
    out: str | Path = "collect",
    *,
    layers=None,
    top_k: int = 5,
    rows: int | Sequence[int] = (-1,),
    spans: Sequence[Sequence[int | None]] = (),
    context: int | None = None,
    field: str = "text",
    key_field: str | None = "id",
    shard_size: int = 256,
    batch_size: int | None = None,
    engine: str = "transformers",
    engine_args: dict | None = None,
    workers: int | None = None,
    max_prompts: int | None = None,
    progress: bool | None = None,
    image_field: str | None = None,
    processor: Any = None,
) -> CollectResult:
    """Compute `features` of every prompt of `corpus` and write them to sharded Parquet under `out`.

    - `model`: a `StandardizedTransformer` or `StandardizedVLLM`, or a checkpoint folder loaded on `engine`
      ("transformers" or "vllm") with `engine_args` (the command line also takes bundled names and tiny:FAMILY).
    - `corpus`: a .jsonl, .txt or .parquet file or a local `datasets.Dataset`, streamed (`field`: the text column or
      JSON field; `key_field`: an optional id kept with each row).
    - `features`: names from `attnlens.collect.FEATURES` (or "all"); `layers` (default every layer serving them),
      `top_k` and `rows` (the query rows of each prompt whose top keys, pattern, span mass or lookback ratio are
      kept, negative from its end); `spans` (token ranges `[start, end)` of every prompt, as Python slices them,
      for `span_mass`) and `context` (how many leading tokens are the context `lookback` weighs against the rest;
      negative: all but that many).
    - `shard_size`: prompts per shard (each shard is one commit); `batch_size`: prompts per forward on eager, per
      trace on vLLM; `max_prompts`: stop after this many new prompts.
    - `workers`: run on Ray with this many workers, one engine each (`model` must then be a folder each worker
      loads; see docs/corpus.md).
    - `image_field`: the JSONL field, Parquet or dataset column naming the image files a prompt shows (a path or a
      list of paths, relative to the corpus file's folder; missing or null: a text prompt). Such a prompt runs alone
      through `processor` (the checkpoint's, `AutoProcessor` from its folder by default; a tiny model's from
      `attnlens.models.tiny_processor`), its images placed by `model.positions`; the `image_share` feature gives the
      text rows' attention on them. The transformers engine only, in this process.

    Started again with the same arguments after a crash, it continues: committed prompts are skipped, so every
    prompt is written exactly once. A folder of another run is refused (`CollectMismatch`). Prompts that cannot run
    go to the errors table (`out/errors`) with the reason.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1; got {shard_size}")
    corpus = (
        corpus
        if isinstance(corpus, Corpus)
        else Corpus(corpus, field=field, key_field=key_field, image_field=image_field)
    )
    options = dict(
        features=[features] if isinstance(features, str) else list(features),
        layers=layers,
        top_k=top_k,
        rows=rows,
        spans=spans,
        context=context,
        batch_size=batch_size,
    )
    if corpus.image_field is not None:
        if workers is not None:
            raise ValueError(
                "collect with images runs in this process: a Ray worker would need the checkpoint's processor, which "
                "collect builds here only (a tiny model's is built in Python, saved with no folder), and the image "
                "files on its own machine; leave workers out"
            )
        if engine_named(engine) != "transformers" or getattr(getattr(model, "access", None), "engine", None) == "vllm":
            raise Unavailable(
                "collect: prompts with images run on the transformers engine (StandardizedTransformer); vLLM's "
                "collection runs plain token requests, which carry no images"
            )
    if workers is not None:
        from .ray_pool import RayPool

        if not isinstance(model, (str, Path)):
            raise TypeError(
                "collect on Ray (workers=...) needs the model as a checkpoint folder each worker loads, "
                "not a loaded model"
            )
        pool = RayPool(str(model), engine, engine_args, options, workers)
        try:
            return _drive(
                pool,
                pool.identity,
                pool.columns,
                pool.layers,
                pool.skipped,
                corpus,
                out,
                shard_size,
                max_prompts,
                progress,
            )
        finally:
            pool.close()
    if isinstance(model, (str, Path)):
        model = load(str(model), engine, engine_args, options["features"], layers)
    if corpus.image_field is not None and processor is None:
        processor = _processor(model)
    collector = Collector(model, **options, processor=processor)
    local = _Local(collector)
    return _drive(
        local,
        collector.identity(),
        collector.columns,
        collector.layers,
        collector.skipped,
        corpus,
        out,
        shard_size,
        max_prompts,
        progress,
    )


def _processor(model):
    """The processor saved with `model`'s checkpoint (`AutoProcessor`, from the folder it was loaded from)."""
    from transformers import AutoProcessor

    folder = getattr(model.config, "_name_or_path", "")
    advice = "pass processor= (a tiny model's: attnlens.models.tiny_processor(family))"
    if not folder:
        raise ValueError(f"collect with images: this model has no folder to load a processor from; {advice}")
    try:
        return AutoProcessor.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001  no processor saved there: say what to pass
        raise ValueError(
            f"collect with images: no processor loads from {folder!r} ({type(error).__name__}); {advice}"
        ) from None


class _Local:
    """Windows computed in this process, one at a time."""

    def __init__(self, collector: Collector):
        self.collector = collector

    def map(self, windows):
        for window in windows:
            yield window, self.collector.window(window)


def _drive(pool, identity, columns, layers, skipped, corpus, out, shard_size, max_prompts, progress) -> CollectResult:
    store, done = Store.open(out, {"corpus": corpus.describe(), **identity}, columns)
    already = len(done)
    try:
        total = len(corpus)
    except TypeError:  # a streamed dataset of unknown length
        total = None
    show = (total is None or total - already > shard_size) if progress is None else progress
    start = time.perf_counter()
    prompts = rows = errors = tokens = shards = 0
    with _progress(show) as bar:
        task = bar.add_task("collect", total=total, completed=already, first=already, tokens=0)
        for window, (found, failed, used) in pool.map(windows(corpus, done, shard_size, max_prompts)):
            covers = [record.index for record in window]
            store.commit(covers, found, failed)
            prompts, rows, errors = prompts + len(window), rows + len(found["prompt"]), errors + len(failed["prompt"])
            tokens, shards = tokens + used, shards + 1
            bar.update(task, advance=len(window), tokens=tokens)
    return CollectResult(
        out=Path(out),
        prompts=prompts,
        rows=rows,
        errors=errors,
        tokens=tokens,
        seconds=time.perf_counter() - start,
        already_done=already,
        total=already + prompts,
        shards=shards,
        layers=layers,
        skipped=skipped,
    )
