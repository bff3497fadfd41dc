"""How the survey looks inside a tiny model: which blocks run a softmax over positions (seen at run time), how each
attention module computes (read off its source), how the model departs from the common layout (`attnlens.Family`)
by name and by running the common layout's identities (`CommonLayoutProbe`, `attnlens.checks`), what attnlens serves
for it; one type's record (`survey_type`), and the worker processes that survey many (`survey`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import torch

from attnlens.family import INTERFACE_CALL, Family, block_list
from tools import ROOT

from .build import DECODER_FLAGS, build, registered, static_facts, tiny_kwargs

#: How long one type may take in a worker (ATTNLENS_SURVEY_SECONDS: longer on a loaded machine).
SECONDS_PER_TYPE = int(os.environ.get("ATTNLENS_SURVEY_SECONDS", "60"))
#: Show the workers' stderr (transformers' warnings, tracebacks of crashes).
VERBOSE = bool(os.environ.get("ATTNLENS_SURVEY_VERBOSE"))
TOKENS = torch.arange(3, 11)[None]  # 8 token ids, clear of pad/bos/eos
PROMPT = "Hello world!"  # 12 characters for the common-layout check: longer than the tiny sliding windows (4)


def first_line(error: BaseException) -> str:
    """The error's type and first line (and the next, where the first only introduces it)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines or [""])[0]
    return f"{type(error).__name__}: {text[:300]}".rstrip(": ")


# --- where the blocks are, and which of them run a softmax over positions ------------------------------------------


class _Softmaxes(torch.overrides.TorchFunctionMode):
    """Records each softmax over positions (input [..., queries, keys] over the last axis, queries = the block's
    sequence length <= keys) with the block and the innermost module running it, through a stack the modules' hooks
    keep."""

    #: A softmax, or its normaliser where the forward writes it as exp(x - logsumexp(x)) (Reformer).
    FUNCTIONS = (
        torch.softmax,
        torch.nn.functional.softmax,
        torch.Tensor.softmax,
        torch.special.softmax,
        torch.logsumexp,
        torch.Tensor.logsumexp,
    )

    def __init__(self, model, layers_path: str, length: int):
        super().__init__()
        self.stack: list[str] = []
        self.seen: list[tuple[int, str]] = []
        self.blocks = {f"{layers_path}.{i}": i for i in range(len(model.get_submodule(layers_path)))}
        #: The sequence lengths a block's queries may have: the prompt's, and its input's (patches, not tokens, in
        #: Blt's global transformer; XLNet's blocks take [seq, batch, hidden]).
        self.length = length
        self.lengths = {name: {length} for name in self.blocks}
        self.modules = dict(model.named_modules())
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(
                module.register_forward_pre_hook(
                    lambda m, args, kwargs, name=name: self._enter(name, args, kwargs), with_kwargs=True
                )
            )
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._leave(), always_call=True))

    def _enter(self, name: str, args, kwargs) -> None:  # hooks return None, or they would replace the input or output
        self.stack.append(name)
        if name in self.blocks:
            hidden = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.ndim == 3), None)
            self.lengths[name] = {self.length} | (set(hidden.shape[:2]) - {1} if hidden is not None else set())

    def _leave(self) -> None:
        self.stack.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCTIONS and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            block = next((name for name in self.stack if name in self.blocks), None)
            if (
                block
                and x.ndim >= 3
                and dim in (-1, x.ndim - 1)
                and x.shape[-2] in self.lengths[block]
                and x.shape[-1] >= x.shape[-2]
            ):
                inner = next(
                    name
                    for name in reversed(self.stack)  # the module computing, not an nn.Softmax
                    if not isinstance(self.modules[name], torch.nn.Softmax)
                )
                self.seen.append(
                    (self.blocks[block], inner[len(block) + 1 :] if inner.startswith(block) else "/" + inner)
                )
        return func(*args, **kwargs)

    def remove(self):
        for handle in self.handles:
            handle.remove()


def run(model, layers_path: str | None) -> tuple[torch.Tensor, dict[int, list[str]]]:
    """One forward on `TOKENS`: the logits, and for each block the modules that ran a softmax over positions (a
    path relative to the block; '/path' from the model for a module the block borrows)."""
    if layers_path is None:
        with torch.no_grad():
            return model(input_ids=TOKENS).logits, {}
    watch = _Softmaxes(model, layers_path, TOKENS.shape[1])
    try:
        with torch.no_grad(), watch:
            logits = model(input_ids=TOKENS).logits
    finally:
        watch.remove()
    seen: dict[int, list[str]] = {}
    for layer, path in watch.seen:
        if path not in seen.setdefault(layer, []):
            seen[layer].append(path)
    return logits, seen


def is_causal(model, logits: torch.Tensor) -> bool:
    """Whether changing the last token leaves every earlier position's logits alone."""
    changed = TOKENS.clone()
    changed[0, -1] = 20
    with torch.no_grad():
        other = model(input_ids=changed).logits
    return bool(torch.allclose(logits[:, :-1], other[:, :-1], atol=1e-5))


# --- how an attention module computes: read off its source --------------------------------------------------------


def _compiled(function):
    from attnlens.parts.source import compiled

    return compiled(function)


def interface_call(cls) -> dict | None:
    """`attnlens.inferred.interface_call`, with the keywords' names, the eager function's qualified name and what it
    does (`eager_operations`), as the records keep them."""
    from attnlens import inferred

    call = inferred.interface_call(cls)
    if call is None:
        return None
    eager = call["eager"]
    return {
        "operation": call["operation"],
        "arguments": call["arguments"],
        "keywords": list(call["keywords"]),
        "eager": _qualname(eager) if eager else None,
        **(eager_operations(eager) if eager else {}),
    }


def _qualname(function) -> str:
    return f"{function.__module__}.{function.__qualname__}"


def _assignment(lines: dict[str, str], anchor: str) -> str | None:
    """The first assignment operation (`x_N` on a line `x = ...`) whose line contains `anchor`."""
    return next(
        (name for name, line in lines.items() if anchor in line and line.startswith(name.rsplit("_", 1)[0] + " =")),
        None,
    )


def eager_operations(function) -> dict:
    """Where the eager function holds the masked scores and the pattern after dropout (by the common layout's
    anchors), and what else it does: sinks, soft-capping."""
    from attnlens.parts.source import operation_lines

    lines = operation_lines(function)
    source = _compiled(function)[1].source
    extras = [name for name, words in EAGER_EXTRAS.items() if any(word in source for word in words)]
    return {
        "scores": _assignment(lines, Family.eager.scores[1]),
        "probabilities": _assignment(lines, Family.eager.probabilities[1]),
        "eager_extras": extras,
    }


#: What the eager function may do besides the common arithmetic, and the words in its source that show it.
EAGER_EXTRAS = {"sinks": ("sinks", "s_aux"), "softcap": ("tanh(", "softcap")}


# --- how a model departs from the common layout -----------------------------------------------------------------


def _module(root, path: str):
    try:
        return root.get_submodule(path) if path else root
    except AttributeError:
        return None


def _attention_module(model, block, path: str):
    return _module(model, path[1:]) if path.startswith("/") else _module(block, path)


def _children(module, word: str = "") -> list[str]:
    return [name for name, _ in module.named_children() if word in name.lower()]


#: The common layout's roles whose absence the inferred layout can take: the blocks and the embeddings are found from
#: the model's structure (as `UnknownLayout` finds them), and a missing final norm or MLP part costs only its value.
#: Role -> the value it costs (None: nothing). Every other difference blocks.
TOLERATED = {
    "layers": None,
    "embed_tokens": None,
    "final_norm": "final_norm_output",
    "activation": "mlp_activation",
    "down_projection": "mlp_neurons",
}


def model_paths(model, layers_path: str) -> dict[str, str]:
    """The model-level paths an inferred layout would use: the block list found, the input embeddings, and the final
    norm where the common layout puts it, beside the blocks (`model.norm` for `model.layers`)."""
    names = {id(m): n for n, m in model.named_modules()}
    parent = layers_path.rpartition(".")[0]
    norm = f"{parent}.{Family.final_norm.rpartition('.')[2]}".lstrip(".")
    return {
        "layers": layers_path,
        "embed_tokens": names.get(id(model.get_input_embeddings())),
        "final_norm": norm if _module(model, norm) is not None else None,
    }


def differences(model, layers_path: str, attention: dict[int, str]) -> list[dict]:
    """Where the model departs from what the common layout (`attnlens.Family`) reads, in the order it reads it: one
    {"role", "expected", "found", "blocking"} each (with "layer" for a block's), checked on the first block of each
    kind among the `attention` blocks (block index -> its attention module's path); [] where every name matches."""
    common = Family()
    found: list[dict] = []

    def differ(role, expected, actual, layer=None):
        found.append(
            {
                "role": role,
                "expected": expected,
                "found": actual,
                "blocking": role not in TOLERATED,
                **({"layer": layer} if layer is not None else {}),
            }
        )

    for role, actual in model_paths(model, layers_path).items():
        if actual != getattr(common, role):
            differ(role, getattr(common, role), actual)
    blocks, kinds = model.get_submodule(layers_path), set()
    for layer, path in attention.items():
        block = blocks[layer]
        if (type(block), path) in kinds:
            continue
        kinds.add((type(block), path))
        module = _attention_module(model, block, path)
        if path != common.attention:
            differ("attention", common.attention, path, layer)
        for role in ("attention_norm", "mlp_norm", "mlp"):
            if _module(block, getattr(common, role)) is None:
                differ(role, getattr(common, role), ", ".join(_children(block)), layer)
        mlp = _module(block, common.mlp)
        for role in ("activation", "down_projection"):
            if mlp is not None and _module(mlp, getattr(common, role)) is None:
                differ(role, getattr(common, role), ", ".join(_children(mlp)), layer)
        if _module(module, common.output_projection) is None:
            differ("output_projection", common.output_projection, ", ".join(_children(module)), layer)
        call = interface_call(type(module))
        if call is None:
            differ("interface_call", INTERFACE_CALL, f"none: {type(module).__name__} computes attention itself", layer)
            continue
        if call["operation"] != INTERFACE_CALL:
            differ("interface_call", INTERFACE_CALL, call["operation"], layer)
        if call["arguments"][:1] != ["self"] or len(call["arguments"]) < 4:  # read by position; the rest may be named
            differ(
                "interface_arguments",
                "self, query, key, value, ...",
                ", ".join(call["arguments"] + [f"{k}=" for k in call["keywords"]]),
                layer,
            )
        if call["eager"] is None:
            differ("eager_function", "eager_attention_forward", None, layer)
            continue
        for role in ("scores", "probabilities"):
            operation, anchor = getattr(Family.eager, role)
            if call[role] != operation:
                differ(f"eager.{role}", f"{operation} on a line with {anchor!r}", call[role], layer)
    return found


#: Config attributes that change attention, reported where set (lists summarised).
CONFIG_FEATURES = (
    "layer_types",
    "sliding_window",
    "attention_chunk_size",
    "no_rope_layers",
    "kv_lora_rank",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "partial_rotary_factor",
    "use_qk_norm",
    "attention_multiplier",
    "logit_scale",
    "residual_multiplier",
    "embedding_multiplier",
    "clip_qkv",
    "alibi",
)


def features(model, layers_path: str, attention: dict[int, str]) -> dict[str, str]:
    """What the attention layers do beyond the common arithmetic, names found in the model and its config: norms in
    the attention module (QK norms mostly), fused projections, output gates, sinks, soft-caps, other norms in the
    block, expert MLPs, windows, chunks, layers without rotary embedding, latent ranks."""
    found: dict[str, str] = {}
    blocks = model.get_submodule(layers_path)
    for layer, path in attention.items():
        block = blocks[layer]
        module = _attention_module(model, block, path)
        kind = type(module).__name__
        norms = _children(module, "norm")
        if norms:  # QK norms mostly; also latent and sub-layer norms
            found.setdefault("attention_norms", f"{kind}: {', '.join(norms)}")
        if not all(_module(module, p) is not None for p in ("q_proj", "k_proj", "v_proj")):
            found.setdefault("projections", f"{kind}: {', '.join(_children(module))}")
        call = interface_call(type(module))
        for extra in (call or {}).get("eager_extras", []):
            found.setdefault(extra, f"in {call['eager']}")
        source = _compiled(type(module).forward)[1].source
        if "sigmoid" in source:
            found.setdefault("output_gate", f"sigmoid in {kind}.forward")
        extra_norms = [n for n in _children(block, "norm") if n not in (Family.attention_norm, Family.mlp_norm)]
        if extra_norms:
            found.setdefault("block_norms", f"{type(block).__name__}: {', '.join(extra_norms)}")
        mlp = _module(block, Family.mlp)
        if mlp is not None and _module(mlp, Family.down_projection) is None:
            found.setdefault("mlp", f"{type(mlp).__name__}: {', '.join(_children(mlp))}")
    config = model.config.get_text_config(decoder=True)
    for name in CONFIG_FEATURES:
        value = getattr(config, name, None)
        if value not in (None, False, 1.0, [], {}):
            found[f"config.{name}"] = _summary(value)
    return found


def _summary(value) -> str:
    if isinstance(value, (list, tuple)) and len(value) > 4:
        kinds = sorted({str(v) for v in value})
        return f"{len(value)} entries of {', '.join(kinds)}" if len(kinds) <= 4 else f"{len(value)} entries"
    return str(value)


# --- running the identities --------------------------------------------------------------------------------------


class CommonLayoutProbe(Family):
    """The common layout, as an inferred family would apply it to a model attnlens does not know: the blocks, the
    embeddings and the final norm found from the structure (`model_paths`); on the blocks that run softmax attention
    at `self_attn`, every value whose module exists there; on the other blocks, their input and output. `dropped`
    names the values left out for a missing module."""

    MODEL_VALUES = ("embeddings", "final_norm_output", "logits")
    SCOPES = {"model": "", "layer": "", "attention": Family.attention, "mlp": Family.mlp}

    def __init__(self, model, layers_path: str, attention_layers: list[int]):
        from attnlens.locations import Location

        self.name_ = f"common layout ({model.config.model_type})"
        paths = model_paths(model, layers_path)
        self.layers, self.embed_tokens = paths["layers"], paths["embed_tokens"]
        self.final_norm = paths["final_norm"] or Family.final_norm  # absent: dropped below
        common = self.locations()
        blocks = model.get_submodule(layers_path)
        self.dropped: set[str] = set()
        self.by_layer = {}
        for layer in range(len(blocks)):
            kept = {}
            for name, location in common.items():
                scope = next(v.scope for v in _values() if v.name == name)
                host = model if scope == "model" else _module(blocks[layer], self.SCOPES[scope])
                path = getattr(location, "module", "")
                if layer not in attention_layers and scope != "model" and name not in ("layer_input", "layer_output"):
                    continue
                if isinstance(path, str) and path and (host is None or _module(host, path) is None):
                    self.dropped.add(name)
                    continue
                assert isinstance(location, Location)
                kept[name] = location
            self.by_layer[layer] = kept
        self.model_locations = {k: v for k, v in self.by_layer[0].items() if k in self.MODEL_VALUES}

    @property
    def name(self):
        return self.name_

    def locations_for(self, config, layer, engine="transformers"):
        return self.model_locations if layer is None else self.by_layer[layer]


def _values():
    from attnlens.values import ALL_VALUES

    return ALL_VALUES


def check(model, family: Family, layers: list[int]) -> dict:
    """Load `model` under `family` (its load-time checks) and run `attnlens.checks` on `layers`: {"ok", "error",
    "failures": {layer: [identity, ...]}}."""
    from attnlens import checks
    from attnlens.models import char_tokenizer
    from attnlens.standardized import StandardizedTransformer

    try:
        standardized = StandardizedTransformer(model, tokenizer=char_tokenizer(), family=family)
        saved = checks.read_everything(standardized, PROMPT)
        failures = {layer: bad for layer in layers if (bad := checks.failures(standardized, saved, layer))}
    except Exception as error:  # noqa: BLE001
        return {"ok": False, "error": first_line(error), "failures": {}}
    return {"ok": not failures, "error": None, "failures": failures}


def layout(kinds: list[str]) -> str:
    """The model's layout from its blocks' kinds ("interface", "own", "none")."""
    present = set(kinds)
    if present == {"none"}:
        return "attention-free"
    if "none" in present:
        return "hybrid"
    return present.pop() if len(present) == 1 else "mixed"


def survey_type(model_type: str) -> dict:
    """The survey's record of one model type (see docs/survey.md for the fields)."""
    record: dict = {"model_type": model_type}
    family = registered().get(model_type)
    record["registered"] = family.__name__ if family else None
    start = time.perf_counter()
    try:
        record.update(static_facts(model_type))
        record["tiny_kwargs"] = tiny_kwargs(model_type)
        model = build(model_type)
        layers_path = block_list(model, any_depth=True)
        logits, softmaxes = run(model, layers_path)
        record["build"] = {"ok": True, "seconds": round(time.perf_counter() - start, 1), "error": None}
    except BaseException as error:  # noqa: BLE001  (the survey's worker turns a timeout into an exception)
        record["build"] = {"ok": False, "seconds": round(time.perf_counter() - start, 1), "error": first_line(error)}
        return record
    try:
        _inspect(model_type, record, model, layers_path, logits, softmaxes, family)
    except Exception as error:  # noqa: BLE001  (recorded, so one type's surprise costs only its own record)
        record["error"] = first_line(error)
    return record


def _inspect(model_type, record, model, layers_path, logits, softmaxes, family) -> None:
    """The record's fields after the build: causality, the blocks' kinds, what attnlens serves, the common layout."""
    record["causal"] = is_causal(model, logits)
    record["encoder_style"] = _encoder_style(model_type, record)
    record["layers_path"] = layers_path
    record.update(_layers(model, layers_path, softmaxes))
    attention = {layer: paths[0] for layer, paths in softmaxes.items()}
    if family is not None:
        family = registered().get(model.config.model_type, family)  # the built text model's own type, as on load
        served = check(model, family(), list(range(len(record["layers"]))))
        record["serves"] = {"family": family.__name__, "check": served}
    else:
        record["serves"] = {"family": None, **_unknown(model), **_inferred(model, len(record["layers"]))}
    if attention and layers_path is not None:
        record["common_layout"] = _common(model, layers_path, attention)


def _encoder_style(model_type: str, record: dict) -> str | None:
    """How the type is an encoder's (None where it is a plain decoder): the decoder of an encoder-decoder, or an
    encoder that is causal only with its decoder flags (built once more without them to see)."""
    if record["encoder_decoder"]:
        return "decoder of an encoder-decoder"
    flags = {k: v for k, v in DECODER_FLAGS.items() if record["tiny_kwargs"].get(k) == v}
    if not flags:
        return None
    needed = ", ".join(f"{k}={v}" for k, v in flags.items())
    try:
        model = build(model_type, **{k: not v for k, v in flags.items()})
        with torch.no_grad():
            logits = model(input_ids=TOKENS).logits
    except Exception:  # noqa: BLE001
        return f"encoder, runs only with {needed}"
    return None if is_causal(model, logits) else f"encoder, causal only with {needed}"


def _layers(model, layers_path: str | None, softmaxes: dict[int, list[str]]) -> dict:
    """Each block's kind (interface, own arithmetic, or no softmax attention) and the attention module's path."""
    if layers_path is None:
        return {"layers": [], "layout": None, "kinds": []}
    blocks = model.get_submodule(layers_path)
    kinds, groups = [], {}
    for layer, block in enumerate(blocks):
        path = (softmaxes.get(layer) or [None])[0]
        module = _attention_module(model, block, path) if path is not None else None
        kind = "none" if module is None else "interface" if interface_call(type(module)) else "own"
        kinds.append(kind)
        key = (kind, type(block).__name__, path, type(module).__name__ if module is not None else None)
        groups.setdefault(key, []).append(layer)
    described = [
        {
            "layers": layers,
            "kind": kind,
            "block": block,
            "attention": path,
            "class": cls,
            **({"children": _children(blocks[layers[0]])} if kind == "none" else {}),
            **({"softmax_modules": softmaxes[layers[0]]} if len(softmaxes.get(layers[0], [])) > 1 else {}),
        }
        for (kind, block, path, cls), layers in groups.items()
    ]
    return {"layers": kinds, "layout": layout(kinds), "kinds": described}


def _inferred(model, depth: int) -> dict:
    """What the inferred common layout (`attnlens.inferred`) makes of an unregistered type: the family and the
    identities on every block, with the values it leaves out on some attention layer; else the first check that
    refused it."""
    from attnlens.inferred import Inferred, NotCommonLayout

    try:
        family = Inferred(model)
    except NotCommonLayout as refusal:
        return {"inferred": None, "refused": {"check": refusal.check, "detail": refusal.detail[:300]}}
    common = set(Family().locations_for(model.config, 0))  # what a common-layout attention layer serves
    served = [set(family.locations_for(model.config, layer)) for layer in family.attention_layers]
    return {
        "inferred": family.name,
        "dropped": sorted(common - set.intersection(*served)),
        "check": check(model, family, list(range(depth))),
    }


def _unknown(model) -> dict:
    from attnlens.family import UnknownLayout

    try:
        return {"unknown_layout": UnknownLayout(model).layers, "error": None}
    except Exception as error:  # noqa: BLE001
        return {"unknown_layout": None, "error": first_line(error)}


def _common(model, layers_path: str, attention: dict[int, str]) -> dict:
    """The common layout against the model: differences by name, features, and the identities on its attention
    blocks (where those hold their attention at `self_attn`, so that the probe can read it). `fits`: the identities
    hold and nothing blocking differs; `dropped`: the values it would then not serve."""
    found = differences(model, layers_path, attention)
    result = {"differences": found, "features": features(model, layers_path, attention), "check": None, "dropped": []}
    if all(d["role"] != "attention" for d in found):
        probe = CommonLayoutProbe(model, layers_path, sorted(attention))
        result["check"] = check(model, probe, sorted(attention))
        result["dropped"] = sorted(probe.dropped)
    passed = result["check"] is not None and result["check"]["ok"]
    result["fits"] = passed and not any(d["blocking"] for d in found)
    return result


# --- workers -------------------------------------------------------------------------------------------------------


def worker(types: list[str]) -> None:
    """Survey `types` in this process, one JSON line before ("start") and after ("record") each."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)

    def timeout(signum, frame):
        raise TimeoutError(f"no result within {SECONDS_PER_TYPE} s")

    signal.signal(signal.SIGALRM, timeout)
    for model_type in types:
        print(json.dumps({"start": model_type}), flush=True)
        signal.alarm(SECONDS_PER_TYPE)
        try:
            record = survey_type(model_type)
        finally:
            signal.alarm(0)
        print(json.dumps({"record": record}, default=str), flush=True)


def _chain(python: str, types: list[str], records: dict) -> None:
    """Run workers of `python` over `types` until each has a record; a worker that dies or hangs costs the type it
    was surveying (recorded as a failed build), and a fresh worker takes the rest."""
    import threading

    pending = list(types)
    while pending:
        process = subprocess.Popen(
            [python, "-m", "tools.survey", "--worker", *pending],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=None if VERBOSE else subprocess.DEVNULL,
            text=True,
        )
        current, timer = None, None
        for line in process.stdout:
            if timer:
                timer.cancel()
            timer = threading.Timer(3 * SECONDS_PER_TYPE, process.kill)
            timer.start()
            message = json.loads(line)
            if "start" in message:
                current = message["start"]
            else:
                records[message["record"]["model_type"]] = message["record"]
                pending.remove(message["record"]["model_type"])
        if timer:
            timer.cancel()
        process.wait()
        if current in pending:
            pending.remove(current)
            records[current] = {
                "model_type": current,
                "build": {
                    "ok": False,
                    "seconds": None,
                    "error": f"the worker died surveying it (exit {process.returncode})",
                },
            }


def survey(types: list[str], python: str = sys.executable, jobs: int = 2) -> dict[str, dict]:
    """Records for `types` in their order, from `jobs` chains of worker processes of `python`."""
    import threading

    records: dict[str, dict] = {}
    threads = [threading.Thread(target=_chain, args=(python, types[i::jobs], records)) for i in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {t: records[t] for t in types}


def installed() -> dict:
    """The installed versions and every causal-LM model type of the installed transformers."""
    import nnsight
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "nnsight": nnsight.__version__,
        },
        "types": list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    }
