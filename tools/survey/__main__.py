"""The survey's command (run from the repository root).

    python -m tools.survey                      # every type on both transformers: docs/survey.json and docs/survey.md
    python -m tools.survey --update llama gpt2  # re-survey these types only and update their records and the page
    python -m tools.survey --render             # docs/survey.md from docs/survey.json as it is
    python -m tools.survey --json out.json      # the records for the installed transformers only (all, or TYPES)
    python -m tools.survey llama gpt2           # those types only, printed

Each type has 60 s in its worker (ATTNLENS_SURVEY_SECONDS to change it: a loaded machine needs more); a type that
runs out is recorded as not built, so an update on a busy machine should raise it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tools import ROOT

from .probe import installed, survey
from .render import JSON_PATH, MARKDOWN_PATH, compact, dump, render

#: The other transformers attnlens supports, surveyed with its own interpreter (`make install-vllm` builds it).
OTHER_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _other(python: str, types: list[str] | None = None) -> dict | None:
    """The other transformers' compact records (of `types`, or all) with its versions and its types in order; None
    where its interpreter is missing."""
    if not Path(python).exists():
        print(f"{python} not found: keeping the previous survey of the other transformers", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "other.json"
        subprocess.run([python, "-m", "tools.survey", "--json", str(out), *(types or [])], cwd=ROOT, check=True)
        data = json.loads(out.read_text())
    return {
        "versions": data["versions"],
        "types": data["types"],
        "records": {t: compact(r) for t, r in data["records"].items()},
    }


def everything(other_python: str) -> dict:
    """The whole survey: every type of the installed transformers, and the other transformers' compact records (the
    last ones generated where its interpreter is missing)."""
    here = installed()
    data = {"versions": here["versions"], "records": survey(here["types"])}
    other = _other(other_python)
    if other is None:
        other = (json.loads(JSON_PATH.read_text()) if JSON_PATH.exists() else {}).get("other")
    else:
        del other["types"]
    data["other"] = other
    return data


def update(data: dict, types: list[str], other_python: str) -> dict:
    """`data` (the committed survey) with the records of `types` surveyed afresh on both transformers. Refused where
    the installed versions are not the ones `data` was made with: a page must not mix them."""
    here = installed()
    if here["versions"] != data["versions"]:
        raise SystemExit(
            f"docs/survey.json was made with {data['versions']}, this Python has {here['versions']}: "
            "run the whole survey (python -m tools.survey)"
        )
    unknown = [t for t in types if t not in here["types"]]
    if unknown:
        raise SystemExit(f"not causal-LM types of transformers {here['versions']['transformers']}: {unknown}")
    fresh = survey(types, jobs=min(2, len(types)))
    data = {**data, "records": {t: fresh.get(t) or data["records"][t] for t in here["types"]}}
    previous = data.get("other")
    other = _other(other_python, types) if previous is not None else None
    if other is not None:
        if other["versions"] != previous["versions"]:
            raise SystemExit(
                f"the other survey was made with {previous['versions']}, {other_python} has "
                f"{other['versions']}: run the whole survey (python -m tools.survey)"
            )
        records = {**previous["records"], **other["records"]}
        data["other"] = {"versions": previous["versions"], "records": {t: records[t] for t in other["types"]}}
    elif previous is not None:
        print(f"the other transformers' records of {', '.join(types)} are left as they were", file=sys.stderr)
    return data


def write(data: dict) -> None:
    JSON_PATH.write_text(dump(data))
    MARKDOWN_PATH.write_text(render(data))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.survey",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("types", nargs="*", help="survey these types only (printed, or with --update or --json)")
    parser.add_argument(
        "--update",
        action="store_true",
        help="re-survey TYPES on both transformers and update their records in docs/survey.json and the page",
    )
    parser.add_argument("--render", action="store_true", help="only write docs/survey.md from docs/survey.json")
    parser.add_argument("--json", help="write the installed transformers' records here (no docs)")
    parser.add_argument(
        "--other",
        default=str(OTHER_PYTHON),
        help="the Python of the other supported transformers (default: %(default)s)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from .probe import worker

        return worker(args.types)
    if args.render:
        MARKDOWN_PATH.write_text(render(json.loads(JSON_PATH.read_text())))
        return None
    if args.update:
        if not args.types:
            parser.error("--update needs the types to re-survey")
        return write(update(json.loads(JSON_PATH.read_text()), args.types, args.other))
    if args.json:
        here = installed()
        types = [t for t in args.types if t in here["types"]] if args.types else here["types"]
        Path(args.json).write_text(
            dump({"versions": here["versions"], "types": here["types"], "records": survey(types)})
        )
        return None
    if args.types:
        for record in survey(args.types, jobs=min(2, len(args.types))).values():
            print(json.dumps(record, indent=1, default=str))
        return None
    return write(everything(args.other))


if __name__ == "__main__":
    main()
