"""The identity checks live in the package (`attnlens.checks`) so that users adding a family can run them too."""

from attnlens.checks import ATTENTION, EXTRA, LAYER, MLP, close, failures, read_everything, visible

__all__ = ["ATTENTION", "EXTRA", "LAYER", "MLP", "close", "failures", "read_everything", "visible"]
