"""The shipped packages: one import namespace (`switchyard.*`), every folder listed in
pyproject.toml, no bare imports of the folders' own names, no import cycles, and no module
over 600 lines."""

from __future__ import annotations

import ast
import functools
import os
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


def project_python_files() -> list[Path]:
    """Every .py file of the checkout, not of a venv, a build or git."""
    found = []
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "dist")
                   and not d.endswith(".egg-info") and d != "__pycache__"]
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    modules = shipped_modules()
    return {name: imports_of(path, name, set(modules)) for name, path in modules.items()}


def test_pyproject_lists_every_package():
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                   ["packages"])
    on_disk = {name for name, path in shipped_modules().items() if path.name == "__init__.py"}
    assert declared == on_disk


def test_no_bare_imports_of_the_project_folders():
    """`import gateway` would work inside the test run (pytest puts the checkout on sys.path for
    fixtures/) and nowhere else: every module imports the project as switchyard.*."""
    bare = []
    for path in project_python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bare += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                     if n.split(".")[0] in TOP_NAMES]
    assert bare == []


def test_no_import_cycles():
    cycles = strongly_connected(import_graph())
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


def test_only_the_app_reaches_into_the_api_handlers():
    """gateway/api/ is the top of the gateway: the handlers build the request model
    (gateway/request/) and drive turns; nothing below them imports them back."""
    climbing = sorted(
        f"{name} -> {target}" for name, targets in import_graph().items()
        if not name.startswith("switchyard.gateway.api") and name != "switchyard.gateway.app"
        for target in targets
        if target.startswith("switchyard.gateway.api"))
    assert climbing == []


def test_services_never_import_each_other():
    services = ("gateway", "scheduler", "worker", "kvstore")
    crossing = sorted(
        f"{name} -> {target}" for name, targets in import_graph().items()
        for target in targets
        if name.split(".")[1] in services and target.split(".")[1] in services
        and name.split(".")[1] != target.split(".")[1])
    assert crossing == []


# Each floor imports only from its own floor and those below it (docs/design.md "Layout").
FLOORS = {"common": 0, "proto": 1, "twins": 1, "gateway": 2, "scheduler": 2, "worker": 2,
          "kvstore": 2, "deploy": 3, "testing": 4}


def test_every_folder_has_a_floor():
    assert set(FLOORS) == TOP_NAMES


def test_no_arrow_climbs_a_floor():
    climbing = sorted(
        f"{name} -> {target}" for name, targets in import_graph().items()
        for target in targets
        if FLOORS[target.split(".")[1]] > FLOORS[name.split(".")[1]])
    assert climbing == []


def test_twins_stand_beside_the_protocol():
    crossing = sorted(f"{name} -> {target}" for name, targets in import_graph().items()
                      for target in targets
                      if {name.split(".")[1], target.split(".")[1]} == {"twins", "proto"})
    assert crossing == []


def test_no_shipped_module_is_over_600_lines():
    """A module a reader can hold in mind: a longer one is split by what it does."""
    long = {name: n for name, path in shipped_modules().items()
            if (n := len(path.read_text().splitlines())) > 600}
    assert not long, f"split these modules (lines): {long}"
