"""The identity checks live in the package (`attnlens.checks`) so that users adding a family can run them too; the
helpers the family tests share."""

import torch
from conftest import PROMPT, tiny

import attnlens
from attnlens.checks import close, failures, read_everything, visible

__all__ = ["close", "failures", "perturbed", "read_everything", "saved_for", "swapped", "trace", "visible"]

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


def swapped(locations_for, layer: int, value: str, other: str):
    """`locations_for` with `value` read where `other` is, on `layer` only (on a hybrid, other layers may lack both),
    moved to that place in the forward order so a value between the two (a gate) is still read in order."""

    def rewired(config, i, engine="eager"):
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
