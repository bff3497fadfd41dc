"""The workshop: what builds the docs and the demo from the library, kept out of the installable package (attnlens
never imports it). Run from the repository root: `python -m tools.survey`, `python -m tools.tables`,
`python -m tools.demo`."""

from pathlib import Path

#: The repository (the docs the tools write live under it).
ROOT = Path(__file__).resolve().parent.parent
