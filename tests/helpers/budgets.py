"""Time budgets of the test files (tests/README.md "Budgets"): the order they start in and the
check that none grew past its budget.

The table is the README's: one row per slow file, `| tests/e2e/test_x.py | 60 |`, and a row
`| every other file | 20 |`. The suite starts the files with the largest budgets first, so
that under `pytest -n 2` the two workers finish together rather than one waiting for a long
file picked last. In CI (SWITCHYARD_TEST_BUDGETS=1, set by `.ci/run`) a file whose tests took
longer than its budget (setup, call and teardown of all its tests, module fixtures included)
fails the run: a slow test shows the day it gets slow, not when the suite reaches CI's limit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
DEFAULT_ROW = "every other file"
_ROW = re.compile(r"^\|\s*`?([^|`]+?)`?\s*\|\s*(\d+)\s*\|")


@dataclass(frozen=True)
class Budgets:
    by_file: dict[str, float]  # path relative to the repository root -> seconds
    default: float

    def of(self, path: str) -> float:
        return self.by_file.get(path, self.default)


def parse_budgets(text: str) -> Budgets:
    """The table under the "## Budgets" heading of `text`."""
    section = text.split("## Budgets", 1)
    if len(section) < 2:
        raise ValueError("no '## Budgets' section")
    by_file, default = {}, None
    for line in section[1].split("\n## ", 1)[0].splitlines():
        match = _ROW.match(line.strip())
        if match is None:
            continue
        name, seconds = match.group(1).strip(), float(match.group(2))
        if name == DEFAULT_ROW:
            default = seconds
        else:
            by_file[name] = seconds
    if default is None:
        raise ValueError(f"the budgets table has no '{DEFAULT_ROW}' row")
    return Budgets(by_file, default)


def load_budgets(path: Path = README) -> Budgets:
    return parse_budgets(path.read_text())


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def slowest_first(paths: Iterable[str], budgets: Budgets) -> list[str]:
    """`paths` in the order to start them: the largest budget first, ties in their own order."""
    paths = list(dict.fromkeys(paths))
    return sorted(paths, key=lambda p: -budgets.of(p))


def over_budget(seconds_by_file: dict[str, float], budgets: Budgets) -> list[str]:
    """One line for each file that took longer than its budget."""
    return [f"{path}: {seconds:.0f} s, budget {budgets.of(path):.0f} s"
            for path, seconds in sorted(seconds_by_file.items())
            if seconds > budgets.of(path)]


def slowest_files(seconds_by_file: dict[str, float], budgets: Budgets, count: int = 20) -> list[str]:
    """The `count` slowest files, one line each with its time and budget: the figures the
    README's table is kept from."""
    ranked = sorted(seconds_by_file.items(), key=lambda kv: -kv[1])[:count]
    return [f"{seconds:6.1f} s  (budget {budgets.of(path):3.0f})  {path}" for path, seconds in ranked]
