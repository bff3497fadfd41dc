"""The survey's page and data: how the records are counted and grouped (`categories`, `group`), docs/survey.md
(`render`) and docs/survey.json (`dump`, one record per line), and the compact records kept of the other supported
transformers (`compact`)."""

from __future__ import annotations

import json

from tools import ROOT

from .build import MODALITY_WORDS

JSON_PATH = ROOT / "docs" / "survey.json"
MARKDOWN_PATH = ROOT / "docs" / "survey.md"


#: Why some types need more than the survey can give them, where the error alone does not say (shown in the notes).
NOTES = {
    "gemma3n": "its vision tower is a timm model (TimmWrapperModel), and timm is not installed",
    "gemma4_assistant": "a draft model for speculative decoding: its forward takes the target model's inputs_embeds "
    "and shared_kv_states, not token ids",
    "gemma4_unified_assistant": "a draft model for speculative decoding: its forward takes the target model's "
    "inputs_embeds and shared_kv_states, not token ids",
    "cpmant": "the prompt's tokens (its context) see each other both ways; only generated tokens are causal",
    "blt": "bytes are grouped into patches: the global transformer's blocks attend over patches, the local encoder "
    "and decoder cross-attend between bytes and patches",
    "xlnet": "a permutation language model: bidirectional unless given a perm_mask",
    "mllama": "its cross-attention blocks (block 1 here) run only with image inputs; on text alone they are skipped",
    "dory": "its recurrent blocks run more than once per forward",
    "nanochat": "model.norm runs twice: on the embeddings before the first block, and after the last",
    "xlm": "no block modules: parallel lists (transformer.attentions, layer_norm1, ffns, layer_norm2), so the "
    "attention modules are the blocks found",
    "zamba": "one transformer block is shared by the hybrid layers",
    "zamba2": "transformer blocks are shared by the hybrid layers",
}
#: How the attention-bearing types attnlens does not register are grouped on the page: latent attention first, then
#: by the role of the first blocking difference (see `differences`), or the probe's outcome.
GROUPS = {
    "attention": "the attention module is not at `self_attn`",
    "attention_norm": "the block's norms or MLP are named otherwise (post-norms, parallel or expert blocks)",
    "mlp_norm": "the block's norms or MLP are named otherwise (post-norms, parallel or expert blocks)",
    "mlp": "the block's norms or MLP are named otherwise (post-norms, parallel or expert blocks)",
    "output_projection": "no `o_proj` in the attention module",
    "interface_call": "the attention computes itself (no attention interface)",
    "interface_arguments": "the attention interface is called with other arguments",
    "eager_function": "no eager attention function",
    "eager.scores": "the eager function differs (soft-caps, sinks, other steps)",
    "eager.probabilities": "the eager function differs (soft-caps, sinks, other steps)",
    "latent": "latent attention (`kv_lora_rank`), as in DeepSeek-V2 and V3",
    "probe": "every name matches, but the probe fails",
    "identity": "every name matches, but an identity fails",
}


def first_difference(common: dict) -> str | None:
    """The first thing that keeps the common layout off the model, in words: a blocking difference of names, else
    the probe's error or first failing identity; None where it fits."""
    if common["fits"]:
        return None
    blocking = [d for d in common["differences"] if d["blocking"]]
    if blocking:
        d = blocking[0]
        return f"{d['role']}: {d['found'] or 'the block itself'} (expected {d['expected']})"
    check = common["check"] or {}
    if check.get("error"):
        return f"probe: {check['error']}"
    layer, failed = next(iter(check.get("failures", {}).items()))
    return f"identity: {failed[0]} (layer {layer})"


def attention_bearing(record: dict) -> bool:
    return record["build"]["ok"] and record.get("layout") not in (None, "attention-free")


def categories(data: dict) -> dict[str, list[str]]:
    """The page's counts: label -> the types counted."""
    records = data["records"]
    version = data["versions"]["transformers"]

    def having(test) -> list[str]:
        return [t for t, r in records.items() if test(r)]

    built = having(lambda r: r["build"]["ok"])
    other = data.get("other") or {}
    return {
        f"causal-LM model types in transformers {version}": list(records),
        "build tiny on CPU and run a forward on 8 token ids": built,
        "refused (do not build)": having(lambda r: not r["build"]["ok"]),
        "attention-bearing: a softmax over positions in at least one block": having(attention_bearing),
        "… every block through the shared attention interface": having(lambda r: r.get("layout") == "interface"),
        "… every block by its own arithmetic": having(lambda r: r.get("layout") == "own"),
        "… some blocks each way": having(lambda r: r.get("layout") == "mixed"),
        "… hybrid: some blocks without softmax attention": having(lambda r: r.get("layout") == "hybrid"),
        "attention-free": having(lambda r: r.get("layout") == "attention-free"),
        "encoder-style: an encoder run as a decoder, or an encoder-decoder's decoder": having(
            lambda r: r.get("encoder_style") or r.get("encoder_decoder")
        ),
        "multimodal: a vision or audio tower, or non-text inputs": having(_multimodal),
        "not causal as built": having(lambda r: r.get("causal") is False),
        "registered in attnlens": having(lambda r: r["registered"]),
        "… whose family's checks pass on the survey's model": having(
            lambda r: r["registered"] and (r.get("serves") or {}).get("check", {}).get("ok")
        ),
        "served by the inferred common layout (unregistered, every check of `attnlens.inferred` passes)": having(
            lambda r: (r.get("serves") or {}).get("inferred")
        ),
        "… whose identities pass on the survey's model": having(
            lambda r: (r.get("serves") or {}).get("inferred") and r["serves"]["check"]["ok"]
        ),
        "attention-bearing, not registered": having(lambda r: attention_bearing(r) and not r["registered"]),
        "common-layout candidates: not registered, the common layout fits": having(candidate),
        "… without dropping a value": having(lambda r: candidate(r) and not r["common_layout"]["dropped"]),
        **(
            {
                f"in transformers {other['versions']['transformers']} too": [
                    t for t in records if t in other["records"]
                ],
                f"served by the inferred common layout in transformers {other['versions']['transformers']}": [
                    t for t, r in other["records"].items() if r.get("inferred")
                ],
            }
            if other
            else {}
        ),
    }


def _multimodal(record: dict) -> list[str]:
    """The record's vision and audio sub-configs and non-text forward inputs."""
    towers = [n for n in record.get("sub_configs", []) if any(w in n for w in MODALITY_WORDS)]
    return towers + record.get("modality_inputs", [])


def candidate(record: dict) -> bool:
    return attention_bearing(record) and not record["registered"] and record["common_layout"]["fits"]


def group(record: dict) -> str:
    """Where an attention-bearing type attnlens does not register goes on the page."""
    common = record["common_layout"]
    if common["fits"]:
        return "fits" + (f", without {', '.join(common['dropped'])}" if common["dropped"] else "")
    if record.get("encoder_style"):
        return "encoder-style"
    if "config.kv_lora_rank" in common["features"]:
        return GROUPS["latent"]
    difference = first_difference(common)
    return GROUPS[difference.split(":")[0]]


def _blocks(record: dict) -> str:
    kinds = record.get("layers") or []
    softmax = [i for i, kind in enumerate(kinds) if kind != "none"]
    return f"{len(softmax)}/{len(kinds)}" + (
        f" ({', '.join(map(str, softmax))})" if 0 < len(softmax) < len(kinds) else ""
    )


def _serves(record: dict) -> str:
    serves = record.get("serves")
    if serves is None:
        return f"{record['registered']} (not built)" if record["registered"] else "—"
    if serves["family"]:
        check = serves["check"]
        return f"{serves['family']}" + ("" if check["ok"] else f" (checks fail: {_check_text(check)})")
    if serves.get("inferred"):
        check = serves["check"]
        return f"{serves['inferred']}" + ("" if check["ok"] else f" (checks fail: {_check_text(check)})")
    refused = f"; not inferred: {serves['refused']['check']}" if serves.get("refused") else ""
    if serves["unknown_layout"]:
        return f"unknown layout (blocks `{serves['unknown_layout']}`){refused}"
    return f"nothing: {serves['error']}"


def _check_text(check: dict) -> str:
    if check["error"]:
        return check["error"]
    layer, failed = next(iter(check["failures"].items()))
    return f"{failed[0]}, layer {layer}"


def _common_text(record: dict) -> str:
    common = record.get("common_layout")
    if common is None:
        return "—"
    if common["fits"]:
        return "fits" + (f" without {', '.join(common['dropped'])}" if common["dropped"] else "")
    return "differs: " + first_difference(common)


def _notes(record: dict, other: dict | None) -> str:
    notes = []
    if not record["build"]["ok"]:
        notes.append(record["build"]["error"])
    if record["model_type"] in NOTES:
        notes.append(NOTES[record["model_type"]])
    if record.get("encoder_style"):
        notes.append(record["encoder_style"])
    elif record.get("encoder_decoder"):
        notes.append("decoder of an encoder-decoder")
    if record.get("causal") is False:
        notes.append("not causal as built")
    if _multimodal(record):
        notes.append("multimodal: " + ", ".join(_multimodal(record)))
    if record.get("same_class_as"):
        notes.append(f"same class as registered {', '.join(record['same_class_as'])}")
    return "; ".join(notes).replace("|", "\\|")


def _other_text(model_type: str, record: dict, other: dict | None) -> str:
    if not other:
        return "?"
    there = other["records"].get(model_type)
    if there is None:
        return "absent"
    if not there["build"]:
        return "fails"
    built = "builds" if there["layout"] == record.get("layout") else f"builds, {there['layout']}"
    return built + (", inferred" if there.get("inferred") else "")


def _checks() -> list[str]:
    from attnlens.inferred import CHECKS

    return list(CHECKS)


def render(data: dict) -> str:
    """docs/survey.md from the survey's data."""
    records, other = data["records"], data.get("other")
    versions = data["versions"]
    lines = [
        "# Causal-LM survey",
        "",
        f"Generated by `python -m tools.survey` with transformers {versions['transformers']}, torch "
        f"{versions['torch']} and nnsight {versions['nnsight']}"
        + (
            f"; the {other['versions']['transformers']} column with transformers {other['versions']['transformers']}"
            if other
            else ""
        )
        + ".",
        "The data, one record per type, is `docs/survey.json`; how each column is found is at the end of the page.",
        "",
        "| | types |",
        "|---|---|",
        *[f"| {label} | {len(types)} |" for label, types in categories(data).items()],
        "",
        "## Attention-bearing types attnlens does not register, by what differs from the common layout",
        "",
    ]
    grouped: dict[str, list[str]] = {}
    for model_type, record in records.items():
        if attention_bearing(record) and not record["registered"]:
            grouped.setdefault(group(record), []).append(model_type)
    for label in sorted(grouped, key=lambda g: (not g.startswith("fits"), g)):
        lines += [
            f"- {label} ({len(grouped[label])}): "
            + ", ".join(f"`{t}`" + (" (hybrid)" if records[t]["layout"] == "hybrid" else "") for t in grouped[label])
        ]
    lines += [
        "",
        "## Attention-bearing types attnlens does not register, by what the inferred common layout makes of them",
        "",
        "Served where every check of `attnlens.inferred.CHECKS` passes, else refused at the "
        "first check that fails (docs/inferred.md):",
        "",
    ]
    inferred: dict[str, list[str]] = {}
    for model_type, record in records.items():
        serves = record.get("serves") or {}
        if attention_bearing(record) and not record["registered"]:
            label = (
                "inferred"
                if serves.get("inferred")
                else f"refused at `{serves['refused']['check']}`"
                if serves.get("refused")
                else "not tried"
            )
            inferred.setdefault(label, []).append(model_type)
    order = ["inferred", *(f"refused at `{c}`" for c in _checks()), "not tried"]
    for label in sorted(inferred, key=order.index):
        lines.append(f"- {label} ({len(inferred[label])}): " + ", ".join(f"`{t}`" for t in inferred[label]))
    version = other["versions"]["transformers"] if other else "other"
    lines += [
        "",
        "## Every type",
        "",
        f"| type | builds | layout | softmax blocks | attnlens serves | {version} | common layout | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model_type, record in records.items():
        built = record["build"]["ok"]
        lines.append(
            f"| `{model_type}` | {'yes' if built else 'no'} | {record.get('layout') or '—'} | "
            f"{_blocks(record) if built else '—'} | {_serves(record)} | "
            f"{_other_text(model_type, record, other)} | {_common_text(record)} | {_notes(record, other)} |"
        )
    return "\n".join([*lines, "", FIELDS]) + "\n"


FIELDS = """## How each column is found

- **type**: every key of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, built as `AutoModelForCausalLM` builds it (a composite
  config's text part goes to a text-only causal-LM class).
- **builds**: a tiny random model (float32, eager attention, seeded) runs one forward on 8 token ids. Its config is
  the config class's default with small sizes (`SIZES` in `tools/survey/build.py`, set where the class has
  the attribute; `TOWER_SIZES` for vision and audio towers), per-layer kind lists cycled so that each kind of block
  is built, the registered family's `Family.tiny` where there is one, and the per-type `OVERRIDES` where the generic
  sizes fail. Each record keeps the keyword arguments used (`tiny_kwargs`); where it does not build, the notes give
  the error's first line.
- **layout**: which blocks run a softmax over positions, seen at run time (a torch function mode records every
  `softmax`, and `logsumexp` over the last axis, whose input is [..., queries, keys] with the block's sequence
  length as queries, and the innermost module running it). A block with one is `interface` if that module's forward
  calls the attention interface (an assignment from `ALL_ATTENTION_FUNCTIONS`, then a call of it), else `own`
  arithmetic; a model is `interface`, `own` or `mixed` when every block has one, `hybrid` when some have none (Mamba,
  linear attention, convolutions, recurrent blocks), `attention-free` when none has.
- **softmax blocks**: how many blocks have one, and which where not all.
- **attnlens serves**: the registered family, with the outcome of `attnlens.checks` on every block of the survey's
  model; else the inferred common layout (`Inferred(type)`, `attnlens.inferred`: the names found from the model's
  structure and the source of its forwards, every check of `attnlens.inferred.CHECKS` passed before it serves), with
  the outcome of `attnlens.checks` on every block; else what `UnknownLayout` finds (block inputs and outputs,
  embeddings, logits) and the first check of the inferred layout that failed.
- **the other transformers**: whether the type exists there, builds, with which layout where it differs, and
  whether the inferred common layout serves it there.
- **common layout**: the common layout (`attnlens.Family`) against the model. First by name, on the first block of
  each kind (`differences`: the attention module at `self_attn` with `o_proj`; `input_layernorm`,
  `post_attention_layernorm` and `mlp` with `act_fn` and `down_proj` in the block; the attention interface called
  as `attention_interface_1` with `(self, query, key, value, ...)` by position; the eager function's masked
  scores as `attn_weights_1` on a line with `+ attention_mask` and its pattern as `attn_weights_3` on a line with
  `dropout(`). The block list, the embeddings and a final norm beside the blocks are found from the structure, so
  their paths differ without blocking; a missing final norm or MLP part costs only its value. Then, where the
  attention sits at `self_attn`, by running it: `CommonLayoutProbe` (the common layout on the softmax blocks,
  values whose module is missing dropped, only block inputs and outputs elsewhere) loads the model, which checks
  every operation's name and anchor, and `attnlens.checks` runs the identities on each softmax block. It *fits*
  when nothing blocking differs and the identities hold; otherwise the column gives the first blocking difference,
  the probe's error, or the first failing identity. Each record also lists `features`: what the attention does
  beyond the common arithmetic (norms in the attention module, QK norms mostly; fused projections, output gates,
  sinks, soft-caps, other norms in the block, expert MLPs, and the config's windows, chunks, layers without rotary
  embedding, latent ranks).
- **notes**: why a type does not build or needs more than token ids, whether it is an encoder (built once more
  without `is_decoder`/`causal` to see whether it is causal without them) or an encoder-decoder's decoder, whether
  it is causal as built (changing the last token leaves the earlier logits alone), whether it is multimodal (vision
  or audio sub-configs, forward parameters for pixels or audio), and registered types served by the same
  causal-LM class."""


def dump(data: dict) -> str:
    """The data as JSON, each type's record on one line (so a diff names the types that changed)."""

    def records(mapping: dict, indent: str) -> str:
        rows = [f"{indent} {json.dumps(t)}: {json.dumps(r, default=str)}" for t, r in mapping.items()]
        return "{\n" + ",\n".join(rows) + f"\n{indent}}}"

    other = data.get("other")
    parts = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items() if k not in ("records", "other")]
    if other is not None:
        parts.append(
            f' "other": {{"versions": {json.dumps(other["versions"])}, "records": {records(other["records"], "  ")}}}'
        )
    parts.append(f' "records": {records(data["records"], " ")}')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def compact(record: dict) -> dict:
    """What the page keeps of a record from the other transformers."""
    return {
        "build": record["build"]["ok"],
        "error": record["build"]["error"],
        "layout": record.get("layout"),
        "layers": record.get("layers"),
        "registered": record.get("registered"),
        "serves_ok": (record.get("serves") or {}).get("check", {}).get("ok"),
        "inferred": (record.get("serves") or {}).get("inferred"),
        "fits": (record.get("common_layout") or {}).get("fits"),
    }
