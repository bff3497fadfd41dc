"""The package's structure holds: a declared order of layers that no import breaks, no import cycle, and the eager
library without its vLLM engine.

Every import counts: at module top, inside functions (lazy) and under `TYPE_CHECKING`. A module may import its own
layer and the layers below it, never one above: catalogue < locations < parts < families < access < engines < tools.
"""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

#: the same on every transformers: run on the newest one only (`make test-eager-vllm` deselects it)
pytestmark = pytest.mark.any_transformers

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attnlens"

#: The layers, lowest first: module names (a package stands for everything in it). Anything not named is a research
#: tool, the top layer (captures, head summaries, the viewer, the CLI, the package's own __init__).
LAYERS = {
    "catalogue": ("attnlens.values", "attnlens.errors", "attnlens.geometry", "attnlens.names"),
    "locations": ("attnlens.locations",),
    "parts": ("attnlens.parts", "attnlens.kernels"),
    "families": ("attnlens.family", "attnlens.families", "attnlens.registry", "attnlens.inferred"),
    "access": (
        "attnlens.access",
        "attnlens.applications",
        "attnlens.points",
        "attnlens.support",
        "attnlens.envoys",
        "attnlens.inputs",
        "attnlens.rebuild",
        "attnlens.row_features",
        "attnlens.checks",
        "attnlens.verification",
    ),
    "engines": ("attnlens.standardized", "attnlens.stacks", "attnlens.vllm"),
}
ORDER = [*LAYERS, "tools"]


def layer_of(module: str) -> str:
    for layer, names in LAYERS.items():
        if any(module == name or module.startswith(name + ".") for name in names):
            return layer
    return "tools"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str], source: str | None = None) -> set[str]:
    """The attnlens modules `path` imports (its text, or `source`), anywhere in it, lazy and type-checking imports
    included (a package's `from . import x` names module x)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    found = {module_name(path): imports(path, modules) for path in paths}
    # a package's __init__ gathers its modules for users; importing a module of the package is not importing them
    return {
        module: {m for m in deps if not (module.startswith(m + ".") and m in modules)} for module, deps in found.items()
    }


def test_no_import_goes_up_a_layer():
    upward = sorted(
        f"{module} ({layer_of(module)}) imports {dep} ({layer_of(dep)})"
        for module, deps in graph().items()
        for dep in deps
        if ORDER.index(layer_of(dep)) > ORDER.index(layer_of(module))
    )
    assert not upward, "\n".join(upward)


def test_the_layer_test_sees_lazy_and_type_checking_imports():
    """The check itself: an upward import inside a function or under TYPE_CHECKING is found."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..access import Access\n"
        "def f():\n    from ..vllm import model\n"
    )
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    found = imports(PACKAGE / "locations" / "probe.py", modules, source)
    assert found == {"attnlens.access", "attnlens.vllm.model"}
    assert {layer_of(module) for module in found} == {"access", "engines"}


def private_imports(source: str) -> list[str]:
    """The private names (`_x`) `source` imports from another attnlens module."""
    return [
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("attnlens"))
        for alias in node.names
        if alias.name.startswith("_")
    ]


def test_no_family_module_imports_a_private_name():
    """A family shares a mechanism through a part or a public name, never by reaching into another's private one."""
    reaching = {
        path.name: names
        for path in sorted((PACKAGE / "families").glob("*.py"))
        if (names := private_imports(path.read_text()))
    }
    assert reaching == {}


def test_the_private_import_check_sees_one():
    assert private_imports("from .cohere2 import _window, vllm_window_note") == ["cohere2._window"]


def test_no_module_imports_one_that_imports_it_back():
    found = graph()
    cycles = []
    for start in found:
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for nxt in found[module]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in path and len(path) < 8:
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(sorted(set(cycles))[:10])


def test_the_eager_library_stands_without_its_vllm_engine(tmp_path):
    """A copy of the package with attnlens/vllm/ deleted imports every module and passes the identity suite of a
    few families (every layer kind of the common layout, a fused and a latent family)."""
    shutil.copytree(PACKAGE, tmp_path / "attnlens", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(tmp_path / "attnlens" / "vllm")
    shutil.copytree(ROOT / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    modules = sorted(
        module_name(p)
        for p in PACKAGE.rglob("*.py")
        if "vllm" not in p.relative_to(PACKAGE).parts and p.name != "__main__.py"
    )
    script = f"import importlib\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(pathlib.Path.home())}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [
        f"tests/test_identities.py::{test}[{case}]"
        for test in ("test_identities_hold", "test_model_values")
        for case in ("llama", "gpt2", "qwen3_next", "deepseek_v3")
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *cases],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout.splitlines()[-1]


def family_members() -> tuple[list[str], list[str]]:
    """`Family`'s own members, as (module paths, the others): a path is a string, or a `str | None` left unset."""
    tree = ast.parse((PACKAGE / "family.py").read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Family").body
    paths, others = [], []
    for node in body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            paths += [target.id for target in node.targets]
        elif isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "str | None":
            paths.append(node.target.id)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            others += [target.id for target in (node.targets if isinstance(node, ast.Assign) else [node.target])]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            others.append(node.name)
    return paths, others


def test_family_states_at_most_25_members_besides_module_paths_each_documented():
    """The base class stays a surface a family author can hold in mind; docs/architecture.md says what each is for."""
    import re

    from attnlens.family import MODULE_PATHS

    paths, others = family_members()
    assert len(paths) == 14 and len(others) <= 25, (paths, others)
    assert sorted(paths) == sorted(MODULE_PATHS), "family.MODULE_PATHS lists the class's module paths"
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Family's members", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)", section))
    assert set(paths) | set(others) <= documented, sorted(set(paths) | set(others) - documented)
