"""The store: sharded Parquet, one row per prompt x layer x head, written so that a crash loses nothing and repeats
nothing.

A folder holds `collect.json` (the run's identity: corpus, model, family, config hash, features and their options,
engine, dtype; a restart that differs is refused), `data/part-N.parquet` (the features) and `errors/part-N.parquet` (the
prompts that could not run, with the reason). Each shard covers a window of corpus prompts, named by the first; the
prompt indexes it covers (data rows and errors alike) are in its footer's metadata.

The data shard's rename is the commit. A window's errors shard is written first, then its data shard, each to a
hidden temporary file that is fsynced, renamed into place and followed by an fsync of the folder. So a kill at any
moment leaves complete shards only: on the next start, temporary files and an errors shard without its data shard
are removed, and the committed data shards' footers say which prompts are done.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import AttnlensError

IDENTITY_FILE = "collect.json"
DATA, ERRORS = "data", "errors"
#: Key of the shard footer's metadata holding the run identity and the covered prompts.
META_KEY = b"attnlens"
#: Identity fields a restart must match (the others are recorded only).
MATCHED = ("corpus", "model", "family", "config_hash", "features", "features_hash", "layers", "engine", "dtype")

ERROR_COLUMNS = {"prompt": "int64", "key": "string", "reason": "string", "detail": "string", "tokens": "int32"}
KEY_COLUMNS = {
    "prompt": "int64",
    "key": "string",
    "tokens": "int32",
    "layer": "int16",
    "head": "int16",
    "kv_head": "int16",
}


class CollectMismatch(AttnlensError, ValueError):
    """A collection folder holds a run of another model, features or engine: it cannot be continued."""


def arrow_type(name: str):
    import pyarrow as pa

    if name.startswith("list<") and name.endswith(">"):
        return pa.list_(arrow_type(name[5:-1]))
    return {
        "float32": pa.float32(),
        "int32": pa.int32(),
        "int16": pa.int16(),
        "int64": pa.int64(),
        "string": pa.string(),
    }[name]


def schema(columns: dict[str, str], identity: dict | None = None):
    import pyarrow as pa

    fields = [pa.field(name, arrow_type(kind)) for name, kind in columns.items()]
    return pa.schema(fields, metadata=None if identity is None else {META_KEY: json.dumps(identity)})


# --- covered prompts as ranges ------------------------------------------------------------------------------------


def ranges(indexes) -> list[list[int]]:
    """Sorted indexes -> [[start, stop), ...]."""
    out: list[list[int]] = []
    for i in sorted(indexes):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


class Done:
    """The prompts committed so far, as merged ranges: `index in done`, `len(done)`."""

    def __init__(self, spans=()):
        self.spans: list[list[int]] = []
        for span in spans:
            self.add(span)

    def add(self, span) -> None:
        out: list[list[int]] = []
        for start, stop in sorted([*self.spans, list(span)]):
            if out and start <= out[-1][1]:
                out[-1][1] = max(out[-1][1], stop)
            else:
                out.append([start, stop])
        self.spans = out

    def __contains__(self, index: int) -> bool:
        at = bisect.bisect_right(self.spans, [index, float("inf")]) - 1
        return at >= 0 and self.spans[at][0] <= index < self.spans[at][1]

    def __len__(self) -> int:
        return sum(stop - start for start, stop in self.spans)


# --- the folder ---------------------------------------------------------------------------------------------------


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write) -> None:
    """`write(temporary path)`, then fsync, rename to `path` and fsync the folder: `path` is whole or absent."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    with open(temporary, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(temporary, path)
    _fsync_dir(path.parent)


@dataclass
class Store:
    """A collection folder, opened for writing by one process (the driver)."""

    folder: Path
    identity: dict
    columns: dict[str, str]

    @classmethod
    def open(cls, folder, identity: dict, columns: dict[str, str]) -> tuple[Store, Done]:
        """Create the folder or continue it: refuses another run's folder (`CollectMismatch`), removes what a kill
        left half-done, and returns the prompts already committed."""
        folder = Path(folder)
        marker = folder / IDENTITY_FILE
        if marker.exists():
            found = json.loads(marker.read_text())
            changed = [name for name in MATCHED if found.get(name) != identity.get(name)]
            if changed:
                detail = "; ".join(f"{name}: {found.get(name)!r} there, {identity.get(name)!r} now" for name in changed)
                raise CollectMismatch(
                    f"{folder} holds a collection of another run ({detail}); continue it with the "
                    f"same corpus, model, features and engine, or collect into a new folder"
                )
        elif folder.exists() and any(folder.iterdir()):
            raise CollectMismatch(
                f"{folder} is not empty and holds no {IDENTITY_FILE}: it is not an attnlens "
                f"collection; collect into a new or empty folder"
            )
        for part in (DATA, ERRORS):
            (folder / part).mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            _atomic_write(marker, lambda path: path.write_text(json.dumps(identity, indent=1) + "\n"))
        store = cls(folder, identity, columns)
        return store, store.recover()

    def recover(self) -> Done:
        import pyarrow.parquet as pq

        for part in (DATA, ERRORS):
            for leftover in (self.folder / part).glob(".*.tmp"):
                leftover.unlink()
        committed = {path.name for path in (self.folder / DATA).glob("part-*.parquet")}
        for orphan in (self.folder / ERRORS).glob("part-*.parquet"):
            if orphan.name not in committed:  # killed between the errors shard and its data shard
                orphan.unlink()
        done = Done()
        for name in sorted(committed):
            meta = json.loads(pq.read_schema(self.folder / DATA / name).metadata[META_KEY])
            for span in meta["covers"]:
                done.add(span)
        return done

    def commit(self, covers: list[int], rows: dict[str, list], errors: dict[str, list]) -> None:
        """Write one window: its errors shard, then its data shard (the commit). `covers`: every prompt index of
        the window, data and errors alike."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        name = f"part-{min(covers):010d}.parquet"
        meta = {**self.identity, "covers": ranges(covers)}
        if errors["prompt"]:
            table = pa.table(errors, schema=schema(ERROR_COLUMNS, meta))
            _atomic_write(self.folder / ERRORS / name, lambda path: pq.write_table(table, path))
        table = pa.table(rows, schema=schema(self.columns, meta))
        _atomic_write(self.folder / DATA / name, lambda path: pq.write_table(table, path, compression="zstd"))


def read_table(folder, part: str = DATA):
    """The whole collection (or its errors, `part="errors"`) as one pyarrow Table."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    files = sorted((folder / part).glob("part-*.parquet"))
    if not (folder / IDENTITY_FILE).exists():
        raise FileNotFoundError(f"{folder} is not an attnlens collection (no {IDENTITY_FILE})")
    if not files:
        return schema(ERROR_COLUMNS).empty_table() if part == ERRORS else None
    return pa.concat_tables([pq.read_table(path) for path in files]).replace_schema_metadata(None)
