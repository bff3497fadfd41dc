"""The identity checks live in the package (`attnlens.checks`) so that users adding a family can run them too; the
helpers the family tests share."""

import torch
from conftest import PROMPT, tiny

from attnlens.checks import close, failures, read_everything, visible

__all__ = ["close", "failures", "read_everything", "saved_for", "trace", "visible"]

_saved: dict = {}


def saved_for(case: str) -> dict:
    """Every value of `case`'s tiny model on PROMPT (`read_everything`), read once per session."""
    if case not in _saved:
        _saved[case] = read_everything(tiny(case), PROMPT)
    return _saved[case]


def trace(model, read, prompt=PROMPT) -> dict:
    """Run `read(model)` (a dict of proxies, in forward order) inside one no-grad trace and return the values."""
    saved = {}
    with torch.no_grad(), model.trace(prompt):
        for name, proxy in read(model).items():
            saved[name] = proxy.save()
    return saved
