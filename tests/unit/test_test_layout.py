"""The test tree itself: pytest imports test modules by basename (the test folders are not
packages), so two files of one name in different folders break collection of the whole suite."""

from collections import Counter
from pathlib import Path


def test_test_file_names_are_unique():
    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert [n for n, count in names.items() if count > 1] == []
