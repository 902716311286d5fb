"""The shipped packages: one import namespace (`switchyard.*`), every folder listed in
pyproject.toml, no bare imports of the folders' own names, and no import cycles."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {name.removeprefix("switchyard."): Path(folder) for name, folder in tomllib.loads(
    (REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}
TOP_NAMES = set(PACKAGE_DIRS)


def shipped_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the shipped packages."""
    modules = {}
    for top, folder in PACKAGE_DIRS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            modules[".".join(["switchyard", top, *parts])] = path
    return modules


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Every switchyard module `path` imports, at any depth of the code (a function-level import
    counts: the cycle check must not be dodged by one)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_pyproject_lists_every_package():
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                   ["packages"])
    on_disk = {name for name, path in shipped_modules().items() if path.name == "__init__.py"}
    assert declared == on_disk


def test_no_bare_imports_of_the_project_folders():
    """`import gateway` would work inside the test run (pytest puts the checkout on sys.path for
    fixtures/) and nowhere else: every module imports the project as switchyard.*."""
    bare = []
    for path in REPO.rglob("*.py"):
        if {".venv", ".git", "build"} & set(path.relative_to(REPO).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bare += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                     if n.split(".")[0] in TOP_NAMES]
    assert bare == []


def test_no_import_cycles():
    modules = shipped_modules()
    graph = {name: imports_of(path, name, set(modules)) for name, path in modules.items()}
    # A package's __init__ is imported with any of its modules; an edge into a package is an
    # edge into its __init__ only, which is what `graph` holds.
    cycles = strongly_connected(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_check_sees_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []
