"""The causal-LM survey: every model type transformers maps to a causal LM, built tiny on CPU and looked inside
(docs/survey.md, docs/survey.json).

For each type: whether a tiny random model (float32, eager attention) builds and runs a forward on 8 token ids; which
of its layers run a softmax over positions (seen at run time) and how (the shared attention interface, or the
module's own arithmetic); what attnlens serves for it; and, where attnlens has no family, how the model differs from
the common layout (`attnlens.Family`), first statically (module and operation names) and then by running the common
layout's identities (`attnlens.checks`) on its attention layers. `docs/survey.md` explains the fields.

Three parts: `build` (the tiny models, from the config classes), `probe` (what runs inside them, one type's record,
the worker processes) and `render` (the counts, the page, the JSON). `python -m tools.survey --help` for the command.
"""

from .build import build, tiny_kwargs
from .probe import survey, survey_type
from .render import JSON_PATH, MARKDOWN_PATH, candidate, compact, dump, render

__all__ = [
    "JSON_PATH",
    "MARKDOWN_PATH",
    "build",
    "candidate",
    "compact",
    "dump",
    "render",
    "survey",
    "survey_type",
    "tiny_kwargs",
]
