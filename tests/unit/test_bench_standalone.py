"""The benchmarks stand on their own: what they share with the tests is shipped, in
`switchyard.testing` (docs/design.md "Layout"), so `bench/` imports nothing from `tests/`."""

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module or "")
    return names


def test_bench_imports_nothing_from_tests():
    reaching = sorted(f"{path.name}: {name}" for path in BENCH.glob("*.py")
                      for name in imports_of(path)
                      if name == "tests" or name.startswith("tests."))
    assert reaching == []


def test_the_check_sees_an_import_of_tests(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from tests.helpers.standin import CRASH_EXIT_CODE\n")
    assert imports_of(probe) == ["tests.helpers.standin"]
