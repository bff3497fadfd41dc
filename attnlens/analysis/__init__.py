"""What the values are for: direct attribution by head and source, lenses, patching and edge knockouts.

Each analysis is a small module above the access layer: it reads and edits the standardized values and takes module
paths from the family, so it runs on every family (and, where said, on vLLM) that serves the values it needs.
`unavailable(model, layer)` says, per analysis, where it is not served and why.
"""

from ..support import register_analyses
from .attribution import Attribution
from .entry import attribution, served, unavailable
from .knockout import knock_out, knocked
from .lens import LogitLens, logit_lens
from .patching import PatchGrid, agreement, attribution_patching, logit_difference, patch
from .reasons import ANALYSES

register_analyses(served)  # support(layer).analyses: what each engine's layer serves of these, and why not

__all__ = [
    "ANALYSES",
    "Attribution",
    "LogitLens",
    "PatchGrid",
    "agreement",
    "attribution",
    "attribution_patching",
    "knock_out",
    "knocked",
    "logit_difference",
    "logit_lens",
    "patch",
    "served",
    "unavailable",
]
