"""What computes a window of prompts, in this process or in a Ray worker.

`Collector` holds one model and the plan (which layers, which values each reads, in forward order) and turns a window
of `Record`s into columns: rows for the prompts that ran, errors for those that could not (empty, longer than the
engine's context, undecodable, or failing alone). It runs in this process, or in each Ray worker (`ray_pool.py`); only
the driver writes the store.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..capture.runs import spans
from ..errors import EngineStopped, Unavailable
from ..family import engine_named
from ..values import BY_NAME
from . import features as registry
from . import inworker
from .corpus import Record
from .store import ERROR_COLUMNS, KEY_COLUMNS


def _hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnlens")
    except PackageNotFoundError:
        return "unknown"


def load(folder: str | Path, engine: str = "transformers", engine_args: dict | None = None, features=None, layers=None):
    """The checkpoint in `folder` (or a hub name) on `engine`: eager attention on `StandardizedTransformer`, or an
    in-process `StandardizedVLLM` (`uni` executor unless `engine_args` say otherwise). On vLLM, where `features`
    read only values tapped at the attention op, the engine declares their static taps (`inworker.points_for`), so
    it runs at vLLM's defaults (compiled, unless `engine_args` say `enforce_eager`) and collects without a trace;
    otherwise it is built eagerly, for traces."""
    engine = engine_named(engine)
    if engine == "transformers":
        from ..standardized import StandardizedTransformer

        return StandardizedTransformer(str(folder), **{"attn_implementation": "eager", **(engine_args or {})})
    if engine != "vllm":
        raise ValueError(f"engine is 'transformers' or 'vllm'; got {engine!r}")
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ..vllm import StandardizedVLLM

    args = {"distributed_executor_backend": "uni", **(engine_args or {})}
    if features is not None and "static_points" not in args:
        resolved = registry.resolve(features)
        if inworker.servable(resolved):
            args["static_points"] = inworker.points_for(resolved, layers)
    return StandardizedVLLM(str(folder), **args)


class Collector:
    """One model, its plan and its options; `window(records)` -> (rows, errors, tokens)."""

    def __init__(
        self,
        model,
        features: Sequence[str],
        layers=None,
        *,
        top_k: int = 5,
        rows: Sequence[int] = (-1,),
        spans: Sequence[Sequence[int | None]] = (),
        context: int | None = None,
        batch_size: int | None = None,
        processor=None,
    ):
        from ..heads import why_not

        self.model = model
        #: The checkpoint's processor, which turns a prompt with images into the model's inputs (None: text only).
        self.processor = processor
        self.features = registry.resolve(features)
        self.names = [f.name for f in self.features]
        self.options = {"top_k": int(top_k), "rows": [int(r) for r in ([rows] if isinstance(rows, int) else rows)]}
        if self.options["top_k"] < 1 and "top_keys" in self.names:
            raise ValueError(f"top_k must be at least 1 with the top_keys feature; got {top_k}")
        # given only where set, so the options (part of a run's identity) of runs from before them stay the same
        if spans:
            if any(len(span) != 2 for span in spans):
                raise ValueError(f"spans: each is [start, end) (end None: to the prompt's end); got {list(spans)}")
            self.options["spans"] = [[start, end] for start, end in spans]
        if context is not None:
            self.options["context"] = int(context)
        self.wants = registry.wants_of(self.features)
        self.vllm = model.access.engine == "vllm"
        # on vLLM: reduced at the attention op (no trace), where every feature reads only the kernel's arguments
        self.reduced = self.vllm and inworker.servable(self.features)
        if self.vllm and getattr(model, "compiled", False) and not self.reduced:
            traced = [f.name for f in self.features if not inworker.servable([f])]
            raise Unavailable(
                f"collect: this engine runs vLLM's compiled model, whose traces read only the attention op's values, "
                f"and {traced} read others; pass the checkpoint folder with engine='vllm' "
                "(collect builds the engine the features need), or build StandardizedVLLM(..., enforce_eager=True)"
            )
        self.batch_size = batch_size or (256 if self.reduced else 32 if self.vllm else 8)
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")

        def reason(layer: int) -> str | None:
            if self.reduced:
                missing = inworker.untapped(model, self.features, layer)
                if missing:
                    return f"vLLM's attention kernel does not receive {missing} as attnlens serves them"
            for feature in self.features:
                why = feature.reason(model, layer) if feature.reason is not None else None
                if why is not None:
                    return f"{feature.name}: {why}"
                if feature.scored and why_not(model, layer) is not None:
                    return f"{feature.name}: {why_not(model, layer)}"
                for name in feature.reads:
                    why = model.access.reasons(layer).get(name)
                    if why is not None:
                        return f"{feature.name}: {name} unavailable: {why}"
            return None

        if layers is None:
            reasons = {layer: reason(layer) for layer in range(model.num_layers)}
            self.layers = [layer for layer, why in reasons.items() if why is None]
            self.skipped = {layer: why for layer, why in reasons.items() if why is not None}
            if not self.layers:
                raise Unavailable(
                    f"collect: no layer of this {model.family.name} model serves {self.names}: {reasons[0]}"
                )
        else:
            self.layers, self.skipped = [], {}
            for layer in sorted(
                {model.access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)}
            ):
                why = reason(layer)
                if why is not None:
                    raise Unavailable(f"collect: layer {layer} on {model.family.name}: {why}")
                self.layers.append(layer)
        #: (layer, the values read there in forward order)
        self.plan = [
            (
                layer,
                sorted(
                    {name for f in self.features for name in f.reads},
                    key=lambda name: model.access.position(name, layer),
                ),
            )
            for layer in self.layers
        ]
        self.columns = {**KEY_COLUMNS, **{c: t for f in self.features for c, t in f.columns.items()}}
        self.keys = self._keys()
        self.limit = context_limit(model)
        self._installed = False
        self.states = {f.name: f.prepare(model, self.layers) for f in self.features if f.prepare is not None}

    # --- identity -------------------------------------------------------------------------------------------------

    def identity(self) -> dict:
        from ..heads import model_name

        model = self.model
        config = model.access.config
        chosen = {"features": self.names, "options": self.options, "layers": self.layers, "columns": self.columns}
        return {
            "model": model_name(model),
            "family": model.family.name,
            "config_hash": _hash(config.to_dict()),
            "features": self.names,
            "options": self.options,
            "features_hash": _hash(chosen),
            "layers": self.layers,
            "skipped": self.skipped,
            "engine": model.access.engine,
            "dtype": str(model_dtype(model)).removeprefix("torch."),
            "attnlens_version": _version(),
            "columns": self.columns,
            "context_limit": self.limit,
        }

    # --- one window ----------------------------------------------------------------------------------------------

    def tokenize(self, record: Record) -> tuple[list[int] | None, str | None, str | None]:
        """(token ids, reason, detail) of a record: ids when it can run, else why not."""
        if record.problem is not None:
            return None, "undecodable", record.problem
        if record.ids is not None:
            ids = record.ids
        elif not record.text:
            return None, "empty", "the prompt has no text"
        else:
            if self.model.tokenizer is None:
                return None, "undecodable", "this model has no tokenizer: give token ids"
            ids = self.model.tokenizer(record.text)["input_ids"]
        if not ids:
            return None, "empty", "the prompt has no tokens"
        vocab = self.model.access.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            return None, "undecodable", f"token ids outside the vocabulary [0, {vocab})"
        if self.limit is not None and len(ids) > self.limit:
            return ids, "too_long", f"{len(ids)} tokens; the engine's context takes {self.limit}"
        return ids, None, None

    def with_images(self, record: Record) -> tuple[dict | None, str | None, str | None]:
        """(the model's inputs, reason, detail) of a record with images: its text and image files through the
        processor (`models.processor_inputs`), else why not."""
        from PIL import Image

        from ..models import processor_inputs

        if self.processor is None:
            return None, "failed", "the prompt has images and the collection was given no processor"
        pictures = []
        for file in record.images or ():
            try:
                with Image.open(file) as image:
                    pictures.append(image.convert("RGB"))
            except OSError as error:
                return None, "undecodable", f"image {file}: {error}"
        try:
            inputs = processor_inputs(self.processor, record.text or "", pictures)
        except Exception as error:  # noqa: BLE001  one prompt the processor refuses (its images and placeholders)
            return None, "undecodable", f"the processor refused it: {type(error).__name__}: {error}"
        ids = inputs["input_ids"]
        if self.limit is not None and ids.shape[-1] > self.limit:
            return inputs, "too_long", f"{ids.shape[-1]} tokens; the engine's context takes {self.limit}"
        return inputs, None, None

    def window(self, records: Iterable[Record]) -> tuple[dict, dict, int]:
        rows = {name: [] for name in self.columns}
        errors = {name: [] for name in ERROR_COLUMNS}
        runnable: list[tuple[Record, list[int]]] = []
        shown: list[tuple[Record, dict]] = []  # prompts with images: a forward each
        for record in records:
            if record.images is not None:
                inputs, reason, detail = self.with_images(record)
                if reason is None:
                    shown.append((record, inputs))
                else:
                    _error(errors, record, reason, detail, None if inputs is None else inputs["input_ids"].shape[-1])
                continue
            ids, reason, detail = self.tokenize(record)
            if reason is None:
                runnable.append((record, ids))
            else:
                _error(errors, record, reason, detail, None if ids is None else len(ids))
        tokens = 0
        results: dict[int, dict] = {}
        for batch in _batches(self.model, runnable, self.batch_size):
            for (record, ids), found in zip(batch, self._run(batch, errors)):
                if found is not None:
                    results[record.index] = found
                    tokens += len(ids)
        for record, inputs in shown:
            ids = inputs["input_ids"][0].tolist()
            found = self._run([(record, ids)], errors, lambda _, inputs=inputs: self._forward_images(inputs))[0]
            if found is not None:
                runnable.append((record, ids))
                results[record.index] = found
                tokens += len(ids)
        for record, ids in sorted(runnable, key=lambda item: item[0].index):
            if record.index in results:
                self._rows(rows, record, len(ids), results[record.index])
        return rows, errors, tokens

    def _run(self, batch, errors, forward=None) -> list[dict | None]:
        """Each prompt's {layer: {column: per-head values}} (by `forward`, default `_forward`, on the batch's token
        ids); a batch that fails runs again prompt by prompt, and a prompt that fails alone goes to the errors table."""
        try:
            found = (forward or self._forward)([ids for _, ids in batch])
        except (ImportError, NameError, SyntaxError):  # the code's fault, not a prompt's: every prompt would fail
            raise
        except Exception as error:  # one bad prompt must not stop the run (the engine stopping must)
            if self.vllm and self.model.stopped():  # the engine's fault, not a prompt's: nothing of it is kept
                raise EngineStopped(
                    f"vLLM's engine stopped during this collection ({type(error).__name__}: {error}; its log says "
                    f"which worker died); the shards committed so far are kept: run the same command again to resume"
                ) from error
            if len(batch) == 1:
                record, ids = batch[0]
                _error(errors, record, "failed", f"{type(error).__name__}: {' '.join(str(error).split())}", len(ids))
                return [None]
            return [self._run([item], errors, forward)[0] for item in batch]
        for i, ((record, ids), result) in enumerate(zip(batch, found)):
            if isinstance(result, str):  # reduced in vLLM's worker, this prompt alone failed there
                _error(errors, record, "failed", result, len(ids))
                found[i] = None
        return found

    def _forward(self, prompts: list[list[int]]) -> list[dict]:
        model, plan, features, options, wants = self.model, self.plan, self.features, self.options, self.wants
        if self.reduced:
            from ..vllm import reducer

            if not self._installed:  # this collection's features, options and plan, in every worker
                compute = inworker.compute(features, options, wants)
                model.vllm_entrypoint.collective_rpc(reducer.install, args=(reducer.pickled(compute), dict(plan)))
                self._installed = True
            return reducer.forward(model, prompts)
        if self.vllm:  # one traced request per prompt; vLLM schedules the requests of a trace together
            with torch.no_grad(), _quiet(model), model.trace(max_tokens=1, temperature=0.0) as tracer:
                for i, ids in enumerate(prompts):
                    with tracer.invoke(ids):
                        found = list().save()
                        compute(model, plan, features, options, wants, [ids], [slice(0, None)], found, i, self.states)
            found = found if len(prompts) > 1 else [found]  # a name saved by several requests comes back as a list
            by_prompt = {entry[0][0]: entry[0][1] for entry in found}
            return [by_prompt[i] for i in range(len(prompts))]
        where = spans(model, [len(ids) for ids in prompts])
        batch_input = torch.tensor([prompts[0]]) if len(prompts) == 1 else [torch.tensor(ids) for ids in prompts]
        found: list = []
        with torch.no_grad(), model.trace(batch_input):
            compute(model, plan, features, options, wants, prompts, where, found, 0, self.states)
        return [entry[1] for entry in sorted(found, key=lambda entry: entry[0])]

    def _forward_images(self, inputs: dict) -> list[dict]:
        """One prompt with images (the processor's inputs), in a trace of its own: `model.positions` says where its
        images sit, for the features that read them and for a family whose image tokens see each other both ways."""
        if self.vllm:
            raise Unavailable("collect: prompts with images run on the transformers engine (StandardizedTransformer)")
        model = self.model
        ids = inputs["input_ids"]
        rest = {name: value for name, value in inputs.items() if name != "input_ids"}
        positions = model.positions(inputs)
        found: list = []
        with torch.no_grad(), model.trace(ids, **rest):
            compute(
                model, self.plan, self.features, self.options, self.wants, [ids[0].tolist()], [slice(0, None)], found,
                0, self.states, [positions],
            )  # fmt: skip
        return [found[0][1]]

    def _rows(self, rows: dict, record: Record, tokens: int, found: dict) -> None:
        keys = self.keys
        count = len(keys["head"])
        rows["prompt"].extend([record.index] * count)
        rows["key"].extend([record.key] * count)
        rows["tokens"].extend([tokens] * count)
        for name, values in keys.items():
            rows[name].extend(values)
        for column in found[self.layers[0]]:
            into = rows[column]
            for layer in self.layers:
                into.extend(_plain(found[layer][column]))

    def _keys(self) -> dict[str, list[int]]:
        """The `layer`, `head` and `kv_head` columns of one prompt's rows: every planned layer's heads in order."""
        keys: dict[str, list[int]] = {"layer": [], "head": [], "kv_head": []}
        for layer in self.layers:
            geometry = self.model.access.geometry(layer)
            paired = self.model.family.score_function().repeat_kv(
                torch.arange(geometry.num_kv_heads).view(1, -1, 1, 1), geometry.num_heads // geometry.num_kv_heads
            )
            keys["layer"] += [layer] * geometry.num_heads
            keys["head"] += list(range(geometry.num_heads))
            keys["kv_head"] += paired.flatten().tolist()
        return keys


@contextlib.contextmanager
def _quiet(model):
    """vLLM's own progress bars off for the requests of a trace: the run has its own."""
    engine = model.vllm_entrypoint
    engine.generate = functools.partial(type(engine).generate, engine, use_tqdm=False)
    try:
        yield
    finally:
        del engine.generate


def _plain(values) -> list:
    """Per-head values (a tensor with heads first, or a list per head of tensors) -> Python values per head."""
    if isinstance(values, torch.Tensor):
        return values.tolist()
    return [[row.tolist() for row in per_head] for per_head in values]


def _error(errors: dict, record: Record, reason: str, detail: str, tokens: int | None) -> None:
    for name, value in zip(ERROR_COLUMNS, (record.index, record.key, reason, detail, tokens)):
        errors[name].append(value)


def _batches(model, runnable: list, batch_size: int) -> list[list]:
    """On eager, prompts of similar lengths together (little padding; equal lengths only where the family's values
    change under left padding); on vLLM, in corpus order (vLLM batches the requests itself)."""
    if model.access.engine == "vllm":
        return [runnable[at : at + batch_size] for at in range(0, len(runnable), batch_size)]
    from ..capture.runs import batches

    return [[runnable[i] for i in batch] for batch in batches(model, [len(ids) for _, ids in runnable], batch_size)]


def compute(model, plan, features, options, wants, prompts, spans, found, first, states, positions=None) -> None:
    """Inside a trace (on vLLM inside its worker, so only the reduced numbers leave it): per prompt of the batch
    (`prompts`: token ids), (its place, {layer: {column: per-head values}}) appended to `found`. Features with a
    `finish` complete theirs from the values after the last layer, read once for the batch. `positions`: each
    prompt's `model.positions` where it holds images (None: text prompts)."""
    from ..points import unpad

    lengths = [len(ids) for ids in prompts]
    results = [{} for _ in spans]
    for layer, reads in plan:
        attn = model.layers[layer].self_attn
        read = {name: getattr(attn, name) for name in reads}
        for i, span in enumerate(spans):
            values = {name: unpad(tensor, BY_NAME[name].short, i, span) for name, tensor in read.items()}
            for name, tensor in values.items():  # a prefill split in chunks would be seen a chunk at a time
                axes = BY_NAME[name].axes
                seen = tensor.shape[axes.index("seq")] if "seq" in axes else lengths[i]
                if seen != lengths[i]:
                    raise ValueError(
                        f"layer {layer}: {name} covers {seen} of the prompt's {lengths[i]} tokens; "
                        f"collect needs whole prefills (turn chunked prefill off or raise "
                        f"max_num_batched_tokens)"
                    )
            shown = None if positions is None else positions[i]
            found_here = registry.features_of(
                [attn], [layer], lengths[i], values, features, options, wants, states, shown
            )
            results[i][layer] = found_here[layer]
    finishing = [feature for feature in features if feature.finish is not None]
    if finishing:
        last = model.layers[model.num_layers - 1]
        hosts = {"layer_output": last, "final_norm_output": model, "logits": model}
        finals = {name: getattr(hosts[name], name) for name in registry.FINALS}
        for i, span in enumerate(spans):
            unpadded = {name: unpad(tensor, BY_NAME[name].short, i, span) for name, tensor in finals.items()}
            prompt = registry.Prompt(list(prompts[i]), registry.rows_of(options, lengths[i]), unpadded, results[i])
            for feature in finishing:
                feature.finish(model, states[feature.name], prompt)
    found.extend((first + i, result) for i, result in enumerate(results))


def context_limit(model) -> int | None:
    """The longest prompt the engine takes: vLLM's `max_model_len` less the one token sampled, else the model's
    positions."""
    if model.access.engine == "vllm":
        engine = getattr(model, "vllm_entrypoint", None)
        if engine is not None:
            return engine.llm_engine.model_config.max_model_len - 1
    config = model.access.config
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def model_dtype(model):
    if model.access.engine == "vllm":
        engine = getattr(model, "vllm_entrypoint", None)
        return engine.llm_engine.model_config.dtype if engine is not None else "auto"
    return next(model._module.parameters()).dtype
