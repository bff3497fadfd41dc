"""attnlens 0.1's spellings of the score function's and the identity oracle's steps, as methods of the family.

Those steps are parts of their own now (`parts.scoring`, `parts.identities`; `family.score_function(engine)`,
`family.identities`). `OldSpelling`, a base of `Family`, keeps the old calls working with a `DeprecationWarning`;
`Family.__init_subclass__` folds a step still written in a family's body into its part (`run_on_the_family`).
"""

from __future__ import annotations

import warnings

from .identities import Identities
from .scoring import ScoreFunction

#: The steps of the score function and of the identity oracle, once methods of `Family` (attnlens 0.1): a family
#: states them in its nested `ScoreFunction` / `Identities`; the old spellings are folded in with a warning.
PART_STEPS = {
    "ScoreFunction": tuple(name for name in vars(ScoreFunction) if not name.startswith("_")),
    "Identities": tuple(name for name in vars(Identities) if not name.startswith("_")),
}


#: The steps that took the engine as an argument (attnlens 0.1), and its position.
OLD_ENGINE_ARGUMENT = {"window": 2, "mask": 7}


def _forwarder(part: str, step: str):
    """attnlens 0.1's `family.<step>(...)`, forwarded to the family's part with a warning. Reached through `super()`
    from a step still written as a method of a family, it runs the step its bases' part gives."""

    def forward(self, *args, **kwargs):
        warnings.warn(f"family.{step} is deprecated: use family.{OLD_PARTS[part]}.{step}", DeprecationWarning, 2)
        stated = [klass for klass in type(self).__mro__ if step in vars(klass) and klass is not OldSpelling]
        owner = super(stated[-1], self) if stated else self  # the class above the last one stating it
        engine = "transformers"
        if part == "ScoreFunction" and step in OLD_ENGINE_ARGUMENT:
            position = OLD_ENGINE_ARGUMENT[step]
            if len(args) > position:
                args, engine = args[:position], args[position]
            engine = kwargs.pop("engine", engine)
        found = getattr(owner, part)(self, engine) if part == "ScoreFunction" else getattr(owner, part)(self)
        return getattr(found, step)(*args, **kwargs)

    return forward


#: What each part is reached by on a family.
OLD_PARTS = {"ScoreFunction": "score_function(engine)", "Identities": "identities"}


class OldSpelling:
    """Base of `Family`: attnlens 0.1's steps of the score function and of the identity oracle as methods of the
    family, deprecated forwarders to the parts."""

    def geometry(self, module):
        """attnlens 0.1's `family.geometry(module)`: the heads are read by the family's sizes now."""
        warnings.warn(
            "family.geometry(module) is deprecated: use family.sizes.geometry(module, family)", DeprecationWarning, 2
        )
        return self.sizes.geometry(module, self)  # type: ignore[attr-defined]


def _old_fact(part: str, fact: str) -> property:
    """attnlens 0.1's `family.<fact>` (a class attribute of a part now), read with a warning."""

    def read(self):
        warnings.warn(f"family.{fact} is deprecated: use family.{OLD_PARTS[part]}.{fact}", DeprecationWarning, 2)
        return getattr(getattr(self, part), fact)

    return property(read)


for _part, _steps in PART_STEPS.items():
    for _step in _steps:
        _default = getattr(ScoreFunction if _part == "ScoreFunction" else Identities, _step)
        setattr(OldSpelling, _step, _forwarder(_part, _step) if callable(_default) else _old_fact(_part, _step))


def run_on_the_family(step):
    """A step written as a method of the family (attnlens 0.1), run as a method of its part: `self` is the family."""
    if not callable(step):
        return step
    return lambda part, *args, **kwargs: step(part.family, *args, **kwargs)
