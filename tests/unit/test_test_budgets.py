"""The test files' budgets (tests/README.md "Budgets", tests/helpers/budgets.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.budgets import (load_budgets, over_budget, parse_budgets, slowest_files,
                                   slowest_first)

TABLE = """# Tests

## Budgets

| file | budget (s) | before |
|---|---|---|
| tests/e2e/test_slow.py | 120 | 80 |
| `tests/e2e/test_mid.py` | 60 | |
| every other file | 30 | |

## Next
| tests/e2e/test_elsewhere.py | 999 |
"""


def test_the_table_is_read_with_its_default_row():
    budgets = parse_budgets(TABLE)
    assert budgets.by_file == {"tests/e2e/test_slow.py": 120.0, "tests/e2e/test_mid.py": 60.0}
    assert budgets.of("tests/unit/test_other.py") == 30.0


def test_slowest_files_start_first_and_ties_keep_their_order():
    budgets = parse_budgets(TABLE)
    paths = ["tests/unit/a.py", "tests/e2e/test_mid.py", "tests/unit/b.py",
             "tests/e2e/test_slow.py", "tests/unit/a.py"]
    assert slowest_first(paths, budgets) == ["tests/e2e/test_slow.py", "tests/e2e/test_mid.py",
                                             "tests/unit/a.py", "tests/unit/b.py"]


def test_a_file_over_its_budget_is_named_with_its_time():
    budgets = parse_budgets(TABLE)
    over = over_budget({"tests/e2e/test_slow.py": 121.4, "tests/e2e/test_mid.py": 59.0,
                        "tests/unit/x.py": 31.0}, budgets)
    assert over == ["tests/e2e/test_slow.py: 121 s, budget 120 s", "tests/unit/x.py: 31 s, budget 30 s"]


def test_the_slowest_files_are_listed_with_their_budgets():
    budgets = parse_budgets(TABLE)
    lines = slowest_files({"tests/unit/x.py": 2.0, "tests/e2e/test_slow.py": 90.25,
                           "tests/e2e/test_mid.py": 61.0}, budgets, count=2)
    assert lines == ["  90.2 s  (budget 120)  tests/e2e/test_slow.py",
                     "  61.0 s  (budget  60)  tests/e2e/test_mid.py"]


def test_a_table_without_a_default_row_is_refused():
    with pytest.raises(ValueError, match="every other file"):
        parse_budgets("## Budgets\n| tests/x.py | 5 |\n")


def test_every_file_in_the_repository_table_exists():
    root = Path(__file__).resolve().parents[2]
    missing = [p for p in load_budgets().by_file if not (root / p).is_file()]
    assert not missing, f"tests/README.md budgets name files that do not exist: {missing}"
