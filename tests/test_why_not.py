"""Every "why not" keeps its promise, on every causal-LM type the survey builds (registered, inferred, unknown,
attention-free, encoder-style, hybrid): on each kind of layer, a value `support()` reports unavailable raises
`attnlens.Unavailable` with exactly that reason when read inside a trace, and a value it reports available reads, in
the layout docs/values.md gives (or `support()` notes how it differs).

One tiny model per type (the survey's own recipe), one trace each: the first layer of each distinct report stands for
its kind.
"""

import json
import warnings

import pytest
import torch
import transformers

import attnlens
from attnlens.models import char_tokenizer
from attnlens.values import ALL_VALUES, SUBLAYER_OF

#: 2 prompts of 6 token ids clear of pad, bos and eos: past the survey's sliding windows (4), and sizes no tiny model's
#: hidden size or head count takes, so a swapped axis shows.
TOKENS = torch.arange(3, 9).repeat(2, 1)
#: The axes whose size the input fixes, on a prefill.
SIZES = {"batch": 2, "seq": 6, "query": 6, "key": 6}


def surveyed() -> tuple:
    """The survey's tiny-model builder and the model types it builds on the installed transformers (docs/survey.json):
    the one place this suite reaches into the survey, so it can be repointed when the survey moves."""
    from tools import survey

    data = json.loads(survey.JSON_PATH.read_text())
    versions = [data, data.get("other") or {}]
    records = next(
        (v["records"] for v in versions if v.get("versions", {}).get("transformers") == transformers.__version__), {}
    )
    built = [t for t, r in records.items() if (r["build"]["ok"] if isinstance(r["build"], dict) else r["build"])]
    return survey.build, built


BUILD, TYPES = surveyed()


def host(model, scope: str, layer: int | None):
    if scope == "model":
        return model
    block = model.layers[layer]
    return block if scope == "layer" else getattr(block, SUBLAYER_OF[scope])


def kinds(model) -> list[int]:
    """The first layer of each distinct `support()` report (reasons and notes)."""
    first: dict = {}
    for layer in range(model.num_layers):
        report = model.support(layer)
        first.setdefault((tuple(report.reasons.items()), tuple(report.notes.items())), layer)
    return list(first.values())


def in_forward_order(model, layers: list[int]) -> list[tuple]:
    """(value, layer) for every value of the model and of `layers`, served ones in the order `order()` gives (the
    unserved ones raise before anything is read, wherever they stand)."""
    before = [(v, None) for v in ALL_VALUES if v.name == "embeddings"]
    after = [(v, None) for v in ALL_VALUES if v.scope == "model" and v.name != "embeddings"]
    blocks = []
    for layer in layers:
        rank = model.order(layer)
        blocks += sorted(((v, layer) for v in ALL_VALUES if v.scope != "model"), key=lambda r: rank.get(r[0].key, -1))
    return before + blocks + after


def layout_differs(value, tensor) -> bool:
    axes = value.axes
    return tensor.dim() != len(axes) or any(tensor.shape[i] != SIZES[a] for i, a in enumerate(axes) if a in SIZES)


@pytest.mark.parametrize("model_type", TYPES)
def test_every_why_not_raises_its_reason_and_every_served_value_reads(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unknown and inferred families' load warnings, transformers' own
        model = attnlens.StandardizedTransformer(BUILD(model_type), tokenizer=char_tokenizer())
    layers = kinds(model)
    reports = {layer: model.support(layer) for layer in layers}
    reads = in_forward_order(model, layers)
    outcomes = []
    with torch.no_grad(), model.trace(TOKENS):
        for value, layer in reads:
            try:
                read = getattr(host(model, value.scope, layer), value.attribute)
                outcomes.append((value, layer, None, read))
            except Exception as error:  # noqa: BLE001  (recorded: every wrong outcome is reported at once)
                outcomes.append((value, layer, error, None))
    wrong = []
    for value, layer, error, read in outcomes:
        report = reports[layers[0] if layer is None else layer]
        reason, note = report[value.key], report.notes.get(value.key)
        where = value.name if layer is None else f"layers[{layer}].{value.key}"
        if reason is not None:
            if not isinstance(error, attnlens.Unavailable) or not str(error).endswith(f": {reason}"):
                wrong.append(f"{where}: support() says {reason!r}; the read gave {error!r}")
        elif error is not None:
            wrong.append(f"{where}: served, but the read raised {error!r}")
        elif not isinstance(read, torch.Tensor) or (layout_differs(value, read) and not note):
            shape = list(read.shape) if isinstance(read, torch.Tensor) else type(read).__name__
            wrong.append(f"{where}: {shape}, not [{value.layout}], and support() notes nothing")
    assert not wrong, "\n".join(wrong)


def test_a_sublayer_the_block_lacks_still_answers_with_the_reason():
    """A Reformer block's attention is `attention`, Granite 4's Mamba layers hold `self_attn = None`: `self_attn` and
    `mlp` are there all the same, and their values, written or read, raise the reason; other names say what is
    missing."""
    for model_type, layer in (("reformer", 0), ("granitemoehybrid", 0)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = attnlens.StandardizedTransformer(BUILD(model_type), tokenizer=char_tokenizer())
        reason = model.support(layer)["self_attn.attention_probabilities"]
        with model.trace(TOKENS):
            attention = model.layers[layer].self_attn
            for write in (False, True):  # each raises before anything is read, so both fit in one trace
                with pytest.raises(attnlens.Unavailable, match="attention_probabilities") as refused:
                    if write:
                        attention.attention_probabilities = 0
                    else:
                        attention.attention_probabilities  # noqa: B018
                assert str(refused.value).endswith(f": {reason}")
            with pytest.raises(AttributeError, match=r"mlp_output is read on model.layers\[i\].mlp"):
                attention.mlp_output  # noqa: B018
            with pytest.raises(AttributeError, match="has no self_attn module, so it has no 'heads'"):
                attention.heads  # noqa: B018
    with pytest.raises(AttributeError, match=r"self_attn is a block's sublayer: model.layers\[i\].self_attn"):
        model.self_attn  # noqa: B018
