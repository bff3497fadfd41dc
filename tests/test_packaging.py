"""What the installable package is: the library with its data files, and not the workshop (tools/)."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

import attnlens

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it)
pytestmark = pytest.mark.any_transformers

PACKAGE = Path(attnlens.__file__).parent
ROOT = PACKAGE.parent
#: Files the package reads at run time besides its modules.
DATA = ("py.typed", "viewer/viewer.css", "viewer/viewer.js", "kernels/row_statistics.c")


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


def test_the_wheel_holds_the_package_data_and_not_the_workshop(tmp_path):
    setuptools = pytest.importorskip("setuptools")
    if Version(setuptools.__version__) < Version("77"):  # pyproject's build-system: built without isolation here
        pytest.skip(f"setuptools {setuptools.__version__} is older than the build-system's 77")
    source = tmp_path / "source"  # a copy, so the build leaves the checkout alone
    shutil.copytree(PACKAGE, source / "attnlens", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    names = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist())
    assert {f"attnlens/{name}" for name in DATA} <= names
    assert not any(name.startswith("tools/") for name in names)
