"""The package as a user gets it: the sdist and the wheel built from a copy of the sources, the wheel installed into a
fresh virtual environment (no editable install, no repository on the path), and used there."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import attnlens

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it); one worker
#: builds and installs once for the module's tests
pytestmark = [pytest.mark.any_transformers, pytest.mark.xdist_group("installed")]

PACKAGE = Path(attnlens.__file__).parent
ROOT = PACKAGE.parent
#: Files the package reads at run time besides its modules.
DATA = ("py.typed", "viewer/viewer.css", "viewer/viewer.js", "kernels/row_statistics.c")
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _imported(tree: ast.AST) -> set[str]:
    """Every module an AST imports, at any depth (lazy imports in functions too), as written."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_the_package_never_imports_the_workshop():
    importing = sorted(
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if any(name == "tools" or name.startswith("tools.") for name in _imported(ast.parse(path.read_text())))
    )
    assert importing == [], "the survey, the docs' tables and the demo live in tools/, outside the package"


def _run(*command, **options) -> subprocess.CompletedProcess:
    run = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=900, **options)
    assert run.returncode == 0, f"{' '.join(map(str, command))} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """dist/ holding the sdist and the wheel, built as `python -m build` builds them: the sdist from a copy of the
    sources (the checkout is left alone), the wheel from the sdist."""
    pytest.importorskip("build")
    folder = tmp_path_factory.mktemp("built")
    source = folder / "source"
    shutil.copytree(PACKAGE, source / "attnlens", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # without isolation: the build backend is the one installed here (pyproject's build-system asks setuptools>=77)
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", folder / "dist", source)
    return folder / "dist"


@pytest.fixture(scope="module")
def installed(built, tmp_path_factory) -> Path:
    """The `bin/` of a fresh virtual environment holding the wheel and the dependencies it declares, which pip
    resolves itself (the CPU torch first, from this machine's disk, so nothing pulls a CUDA build)."""
    venv = tmp_path_factory.mktemp("installed") / "venv"
    _run(sys.executable, "-m", "venv", venv)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run(*pip, f"torch=={_installed_version('torch')}")
    _run(*pip, next(built.glob("*.whl")))
    return venv / "bin"


def _installed_version(name: str) -> str:
    from importlib.metadata import version

    return version(name).split("+")[0]


def test_the_sdist_and_wheel_hold_the_package_data_and_not_the_workshop(built):
    wheel = set(zipfile.ZipFile(next(built.glob("*.whl"))).namelist())
    assert {f"attnlens/{name}" for name in DATA} <= wheel
    assert not any(name.startswith(("tools/", "tests")) for name in wheel)
    assert sorted(path.name for path in built.iterdir()) == [
        f"attnlens-{VERSION}-py3-none-any.whl",
        f"attnlens-{VERSION}.tar.gz",
    ]


#: Run by the installed interpreter, in a folder outside the repository: where attnlens was imported from, the
#: README's example on a tiny model, the viewer, the kernel compiled from the installed source.
USE = r"""
import json, os, shutil, sys
from importlib import resources

import torch
import attnlens
from attnlens import kernels

report = {"file": attnlens.__file__, "version": attnlens.__version__, "path": sys.path}
report["data"] = {name: (resources.files("attnlens") / name).is_file() for name in DATA}

# the README's example, SmolLM2 swapped for a tiny Llama of its shape where the example reads it (layer 10, head 4)
README_EXAMPLE

report["pattern"] = list(pattern.shape)
report["ablated"] = bool(torch.isfinite(logits).all())

page = attnlens.show(model, "Hello world", layers=[10]).save("viewer.html")
html = open("viewer.html").read()
# every line of the installed CSS and JavaScript is in the page (but those naming the viewer's id, filled in there)
report["viewer"] = [
    line
    for name in ("viewer.css", "viewer.js")
    for line in (resources.files("attnlens") / "viewer" / name).read_text().splitlines()
    if line.strip() and "ROOT" not in line and line not in html
]

report["kernel"] = kernels.available()
report["kernel_source"] = str(kernels.SOURCE)
report["compiled"] = sorted(os.listdir(os.environ["ATTNLENS_CACHE"]))
report["compiler"] = shutil.which(os.environ.get("CC", "cc"))
print(json.dumps(report))
"""


def _readme_example() -> str:
    """The README's first Python block, its model a tiny Llama with SmolLM2's layer count and head count."""
    block = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    model_line = next(line for line in block.splitlines() if line.startswith("model = "))
    shape = "num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=144"
    return block.replace(model_line, f'model = attnlens.models.tiny("llama", {shape})')


@pytest.fixture(scope="module")
def used(installed, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("user")
    script = USE.replace("README_EXAMPLE", _readme_example()).replace("DATA", repr(DATA))
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", ATTNLENS_CACHE=str(folder / "cache"))
    (folder / "cache").mkdir()
    run = _run(installed / "python", "-c", script, cwd=folder, env=env)
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_installed_package_is_imported_from_the_environment_not_the_repository(used, installed):
    venv = installed.parent
    assert Path(used["file"]).is_relative_to(venv)
    assert not any(Path(entry).resolve() == ROOT.resolve() for entry in used["path"] if entry)
    assert used["version"] == VERSION
    assert all(used["data"].values()), used["data"]


def test_the_readmes_example_runs_on_the_installed_package(used):
    assert used["pattern"][:2] == [1, 9] and used["ablated"]


def test_the_installed_viewer_embeds_its_css_and_javascript(used):
    assert used["viewer"] == [], "lines of the viewer's CSS or JavaScript missing from its page"


def test_the_kernel_compiles_from_the_installed_source(used, installed):
    assert Path(used["kernel_source"]).is_relative_to(installed.parent)
    if used["compiler"] is None:  # documented: no C compiler, the PyTorch path is taken, and available() says why
        assert "could not be built" in used["kernel"]
    else:
        assert used["kernel"] is None
        assert any(name.startswith("row_statistics-") and name.endswith(".so") for name in used["compiled"])


def test_the_installed_command_line(installed, tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    assert _run(installed / "attnlens", "--version", cwd=tmp_path, env=env).stdout.strip() == f"attnlens {VERSION}"
    families = _run(installed / "attnlens", "families", cwd=tmp_path, env=env).stdout
    assert re.search(r"│ Llama +│ llama +│ ✓", families), families[:2000]


#: Run by the installed interpreter: a page's Python blocks in order, in one namespace, each from a file of its own
#: (nnsight reads a trace's body back from its source), printing what each printed as one JSON list per block.
PAGE = r"""
import contextlib, io, json, pathlib, sys

printed = []
namespace = {"__name__": "page"}
for number, block in enumerate(json.loads(pathlib.Path("blocks.json").read_text())):
    script = pathlib.Path(f"block_{number}.py")
    script.write_text(block)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(block, str(script.resolve()), "exec"), namespace)
    printed.append(buffer.getvalue().splitlines())
print(json.dumps(printed))
"""


def test_adding_a_family_runs_as_written_on_the_installed_package(installed, tmp_path):
    """docs/extending.md, the walk-through of a family for a model of one's own, from the wheel alone: its models
    (`attnlens.toys`) ship in the package."""
    from test_docs import BLOCK, expected_output

    blocks = BLOCK.findall((ROOT / "docs" / "extending.md").read_text())
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", ATTNLENS_CACHE=str(tmp_path / "cache"))
    run = _run(installed / "python", "-c", PAGE, cwd=tmp_path, env=env)
    printed = json.loads(run.stdout.strip().splitlines()[-1])
    for block, lines in zip(blocks, printed):
        for want in expected_output(block):
            assert any(line.strip() == want.strip() for line in lines), (want, lines)
