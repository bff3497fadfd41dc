"""The identity checks live in the package (`attnlens.checks`) so that users adding a family can run them too."""

from attnlens.checks import close, failures, read_everything, visible

__all__ = ["close", "failures", "read_everything", "visible"]
