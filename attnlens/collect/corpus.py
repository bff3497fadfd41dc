"""Reading a corpus one record at a time: JSONL, text and Parquet files and local `datasets` datasets.

Every reader yields `Record`s in corpus order, numbered from 0; nothing is loaded whole (files are read line by line
or a row group's batch at a time, datasets are iterated). A record that cannot become a prompt (invalid UTF-8 or
JSON, a missing or non-text field) is still yielded, with `problem` saying why, so that the run writes it to the
errors table instead of dropping it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: File suffixes -> reader kind.
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".txt": "text", ".text": "text", ".parquet": "parquet"}
#: Parquet rows read at a time.
PARQUET_BATCH = 1024


@dataclass
class Record:
    """One corpus entry: its position `index` (0-based), an optional `key` (the corpus's own id), and the prompt as
    `text` or token ids (`ids`), or `problem`: why it cannot be one; `images`: the image files the prompt shows (the
    corpus's `image_field`), None for a text prompt."""

    index: int
    text: str | None = None
    ids: list[int] | None = None
    key: str | None = None
    problem: str | None = None
    images: list[str] | None = None


class Corpus:
    """A streamed corpus: `iter(corpus)` yields `Record`s; `len(corpus)` counts them without keeping any.

    `source` is a path to a JSONL, text or Parquet file (by suffix; `kind` overrides) or a `datasets.Dataset` /
    `IterableDataset`. `field` names the text of a JSONL object, a Parquet column or a dataset column (a list of
    ints there is taken as token ids); `key_field` an optional id kept with each row. In a text file each line is
    one prompt (a blank line is an empty prompt, recorded as an error). `image_field` names a field or column holding
    the image files a prompt shows (a path, or a list of paths; relative to the corpus file's folder), where a row
    may have images: a row without the field, or with null, is a text prompt.
    """

    def __init__(
        self,
        source: Any,
        *,
        field: str = "text",
        key_field: str | None = "id",
        kind: str | None = None,
        image_field: str | None = None,
    ):
        self.source, self.field, self.key_field, self.image_field = source, field, key_field, image_field
        if isinstance(source, (str, Path)):
            path = Path(source).expanduser()
            if not path.is_file():
                raise FileNotFoundError(
                    f"corpus {source}: no such file (a .jsonl, .txt or .parquet file, or a datasets.Dataset)"
                )
            kind = kind or SUFFIXES.get(path.suffix.lower())
            if kind not in SUFFIXES.values():
                raise ValueError(
                    f"corpus {source}: cannot tell its format from {path.suffix!r}; name a .jsonl, "
                    f".txt or .parquet file or pass kind='jsonl', 'text' or 'parquet'"
                )
            self.path: Path | None = path
        elif hasattr(source, "column_names") and hasattr(source, "__iter__"):
            kind, self.path = "dataset", None
            if source.column_names is not None and field not in source.column_names:
                raise ValueError(
                    f"corpus: the dataset has no column {field!r}; its columns: "
                    f"{', '.join(source.column_names)} (choose one with field=)"
                )
        else:
            raise TypeError(
                f"corpus: a path to a .jsonl, .txt or .parquet file or a datasets.Dataset; got {type(source).__name__}"
            )
        self.kind = kind
        if kind == "parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(self.path).names
            if field not in names:
                raise ValueError(
                    f"corpus {source}: no column {field!r}; its columns: {', '.join(names)} (choose one with field=)"
                )
            self.key_field = key_field if key_field in names else None
            if image_field is not None and image_field not in names:
                raise ValueError(
                    f"corpus {source}: no column {image_field!r} for the images; its columns: {', '.join(names)}"
                )
        if image_field is not None and kind == "text":
            raise ValueError(f"corpus {source}: a text file holds no image field; give a .jsonl or .parquet corpus")

    def describe(self) -> str:
        """What the corpus is, for the run's identity: the file's absolute path, or a dataset's size and columns."""
        images = f", images in {self.image_field!r}" if self.image_field else ""
        if self.path is not None:
            return str(self.path.resolve()) + images
        columns = ",".join(self.source.column_names or [])
        size = len(self.source) if hasattr(self.source, "__len__") else "streamed"
        return f"dataset of {size} rows ({columns}), column {self.field!r}{images}"

    def __len__(self) -> int:
        if self.kind == "dataset":
            return len(self.source)
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(self.path).metadata.num_rows
        count, last = 0, b"\n"
        with open(self.path, "rb") as file:
            while chunk := file.read(1 << 20):
                count, last = count + chunk.count(b"\n"), chunk[-1:]
        return count + (last != b"\n")  # a last line without its newline counts too

    def __iter__(self) -> Iterator[Record]:
        reader = {"jsonl": self._jsonl, "text": self._text, "parquet": self._parquet, "dataset": self._dataset}
        return reader[self.kind]()

    # --- the readers -------------------------------------------------------------------------------------------

    def _lines(self) -> Iterator[tuple[int, str | None, str | None]]:
        with open(self.path, "rb") as file:
            for index, raw in enumerate(file):
                raw = raw[:-1] if raw.endswith(b"\n") else raw
                raw = raw[:-1] if raw.endswith(b"\r") else raw
                try:
                    yield index, raw.decode("utf-8"), None
                except UnicodeDecodeError as error:
                    yield (
                        index,
                        None,
                        f"undecodable: line {index + 1} is not valid UTF-8 ({error.reason} at byte {error.start})",
                    )

    def _text(self) -> Iterator[Record]:
        for index, line, problem in self._lines():
            yield Record(index, text=line, problem=problem)

    def _jsonl(self) -> Iterator[Record]:
        for index, line, problem in self._lines():
            if problem is not None:
                yield Record(index, problem=problem)
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                yield Record(index, problem=f"undecodable: line {index + 1} is not JSON ({error.msg})")
                continue
            yield self._record(index, item if isinstance(item, dict) else {self.field: item})

    def _parquet(self) -> Iterator[Record]:
        import pyarrow.parquet as pq

        columns = [self.field] + [name for name in (self.key_field, self.image_field) if name]
        index = 0
        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=PARQUET_BATCH, columns=columns):
            for item in batch.to_pylist():
                yield self._record(index, item)
                index += 1

    def _dataset(self) -> Iterator[Record]:
        for index, item in enumerate(self.source):
            yield self._record(index, item)

    def _record(self, index: int, item: dict) -> Record:
        key = item.get(self.key_field) if self.key_field else None
        key = None if key is None else str(key)
        if self.field not in item:
            return Record(
                index,
                key=key,
                problem=f"undecodable: no field {self.field!r} (has {', '.join(map(str, item)) or 'none'})",
            )
        value = item[self.field]
        images, problem = self._images(item)
        if problem is not None:
            return Record(index, key=key, problem=problem)
        if isinstance(value, str):
            return Record(index, text=value, key=key, images=images)
        if isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            if images is not None:
                return Record(index, key=key, problem="undecodable: a prompt with images is given as text")
            return Record(index, ids=list(value), key=key)
        return Record(
            index,
            key=key,
            problem=f"undecodable: field {self.field!r} holds {type(value).__name__}, not text or a list of token ids",
        )

    def _images(self, item: dict) -> tuple[list[str] | None, str | None]:
        """(the image files of a row, resolved against the corpus file's folder, or None; why they are unusable)."""
        value = item.get(self.image_field) if self.image_field else None
        if value is None:
            return None, None
        files = [value] if isinstance(value, str) else value
        if not isinstance(files, (list, tuple)) or not files or not all(isinstance(f, str) and f for f in files):
            return None, f"undecodable: field {self.image_field!r} holds {value!r}, not an image path or a list of them"
        folder = self.path.parent if self.path is not None else Path()
        return [str(folder / Path(f).expanduser()) for f in files], None
