"""The package's structure holds: no module imports one that imports it back (function-level imports included,
type-checking ones not)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "attnlens"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The attnlens modules `path` imports, anywhere in it (a package's `from . import x` names module x)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    for block in ast.walk(tree):  # type-checking imports never run
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def test_no_module_imports_one_that_imports_it_back():
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {module_name(path): imports(path, modules) for path in paths}
    # a package's __init__ gathers its modules for users; it is not imported by them
    graph = {module: {m for m in deps if not (module.startswith(m + ".") and m in modules)} for module, deps in
             graph.items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            module, path = stack.pop()
            for nxt in graph[module]:
                if nxt == start:
                    cycles.append(" -> ".join([*path, start]))
                elif nxt not in path and len(path) < 8:
                    stack.append((nxt, [*path, nxt]))
    assert not cycles, "\n".join(sorted(set(cycles))[:10])
