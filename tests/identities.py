"""The identity checks live in the package (`attnlens.checks`) so that users adding a family can run them too; the
helpers the family tests share."""

import contextlib
import sys

import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.checks import close, failures, read_everything, visible
from attnlens.family import PART_STEPS
from attnlens.models import char_tokenizer

__all__ = [
    "LAYER",
    "N",
    "at",
    "attention_module",
    "close",
    "failures",
    "failures_with",
    "heads",
    "ids",
    "merged",
    "mlp_of",
    "perturbed",
    "read_everything",
    "replaced",
    "rope",
    "saved_for",
    "shared",
    "swapped",
    "trace",
    "visible",
]

#: The test prompt's length in tokens (the character tokenizer: one per character).
N = len(PROMPT)
#: The layer most family tests read: the middle of the tiny models' three.
LAYER = 1

_saved: dict = {}


def saved_for(case: str) -> dict:
    """Every value of `case`'s tiny model on PROMPT (`read_everything`), read once per session."""
    if case not in _saved:
        _saved[case] = read_everything(tiny(case), PROMPT)
    return _saved[case]


def perturbed(case, names, **config):
    """A fresh tiny model of `case` with the parameters called `names` (anywhere) moved off their initial values."""
    model = attnlens.models.tiny(case, **config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model._module.named_parameters():
            if name.rsplit(".", 1)[-1] in names:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model


def at(case: str, name: str, layer: int = LAYER):
    """`name` of `layer` of `case`'s tiny model on PROMPT (`saved_for`)."""
    return saved_for(case)[(layer, name)]


def attention_module(case: str, layer: int = LAYER):
    """The transformers attention module of `layer` of `case`'s tiny model."""
    return tiny(case).layers[layer].self_attn._module


def mlp_of(model, layer: int):
    """The transformers MLP module of `layer` (the family's `mlp_module`)."""
    return model.family.identities.mlp_module(model.layers[layer]._module)


def shared(model, layer: int):
    """The shared transformer block a hybrid layer runs (Zamba's `family.shared`)."""
    block = model.layers[layer]._module
    return getattr(block, model.family.shared)


def heads(x, head_dim: int):
    """[b, s, n * d] -> [b, n, s, d]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def merged(heads):
    """[b, s, n, d] -> [b, s, n * d]."""
    return heads.reshape(*heads.shape[:2], -1)


def ids(prompt: str = PROMPT):
    """The character tokenizer's ids of `prompt`, [1, seq]."""
    return char_tokenizer()(prompt, return_tensors="pt").input_ids


def rope(model, layer: int, q, k):
    """The family's own rotary embedding (transformers' function and cos/sin), applied to [b, h, s, d] q and k."""
    module = model.layers[layer].self_attn._module
    positions = torch.arange(q.shape[2])[None]
    cos, sin = model._module.model.rotary_emb(q, positions)
    return sys.modules[type(module).__module__].apply_rotary_pos_emb(q, k, cos, sin)


@contextlib.contextmanager
def replaced(family, **functions):
    """`family` with some of its methods, or steps of its score function or identity oracle (functions of the step's
    arguments, without `self`), replaced until the block ends."""
    by_part = {part: {n: f for n, f in functions.items() if n in steps} for part, steps in PART_STEPS.items()}
    own = {n: f for n, f in functions.items() if not any(n in changed for changed in by_part.values())}
    for part, changed in by_part.items():
        if changed:
            base = getattr(type(family), part)
            setattr(family, part, type(part, (base,), {n: staticmethod(f) for n, f in changed.items()}))
    for name, function in own.items():
        setattr(family, name, function)
    try:
        yield family
    finally:
        for name in [part for part, changed in by_part.items() if changed] + list(own):
            delattr(family, name)


def failures_with(model, replaced_functions: dict, layer: int):
    """The identities of `layer` with the family's methods, score-function steps or oracle steps replaced for one
    run."""
    with replaced(model.family, **replaced_functions):
        model.access.refresh()
        try:
            return failures(model, read_everything(model, PROMPT), layer)
        finally:
            model.access.refresh()


def swapped(locations_for, layer: int, value: str, other: str):
    """`locations_for` with `value` read where `other` is, on `layer` only (on a hybrid, other layers may lack both),
    moved to that place in the forward order so a value between the two (a gate) is still read in order."""

    def rewired(config, i, engine="transformers"):
        locations = locations_for(config, i, engine)
        if i != layer:
            return locations
        moved = {}
        for name, location in locations.items():
            if name == "attention_key_positions":  # derived from the keys: it would follow them
                continue
            if name == other:
                moved[value] = location
            if name != value:
                moved[name] = location
        return moved

    return rewired


def trace(model, read, prompt=PROMPT) -> dict:
    """Run `read(model)` (a dict of proxies, in forward order) inside one no-grad trace and return the values."""
    saved = {}
    with torch.no_grad(), model.trace(prompt):
        for name, proxy in read(model).items():
            saved[name] = proxy.save()
    return saved
