"""Shared fixtures.

MLX tests expect an optimized BLAS on Linux: `.ci/run` starts pytest with
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 (it cannot be set from here,
the dynamic loader reads it at process start). Without it they pass, only slower.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers.budgets import (file_of, load_budgets, over_budget, slowest_files,
                                   slowest_first)

_SPENT: dict[str, float] = defaultdict(float)  # seconds per test file (tests/README.md "Budgets")


def pytest_collection_modifyitems(items):
    """The files with the largest budgets start first (tests/helpers/budgets.py); a file's
    tests keep their order."""
    order = {path: n for n, path in enumerate(
        slowest_first((file_of(item.nodeid) for item in items), load_budgets()))}
    items.sort(key=lambda item: order[file_of(item.nodeid)])


def pytest_runtest_logreport(report):
    _SPENT[file_of(report.nodeid)] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    """Each slow file's time beside its budget, so the table in tests/README.md is kept true
    from the output of any whole run (only the controller has every file's time)."""
    if _SPENT and not hasattr(config, "workerinput"):
        terminalreporter.write_sep("=", "slowest test files (tests/README.md \"Budgets\")")
        for line in slowest_files(dict(_SPENT), load_budgets()):
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    """In CI, a test file over its budget fails the run (tests/README.md "Budgets")."""
    if os.environ.get("SWITCHYARD_TEST_BUDGETS") != "1" or hasattr(session.config, "workerinput"):
        return  # only the controller (or a run without workers) has every file's time
    over = over_budget(dict(_SPENT), load_budgets())
    if over:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_sep("=", "test files over their budget (tests/README.md)", red=True)
            for line in over:
                reporter.write_line(line)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _pillow_bomb_limit_restored():
    """The gateway's image decoder sets Pillow's process-wide pixel limit to
    --max-image-pixels (its second line against decompression bombs); a test that builds one
    in-process must not leave a tiny limit to the tests that follow it in the same worker."""
    from PIL import Image

    before = Image.MAX_IMAGE_PIXELS
    yield
    Image.MAX_IMAGE_PIXELS = before


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch="qwen3", fmt="mlx", **kw) -> Path, generated once per session."""
    from fixtures.tiny_models import generate_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    made: dict[tuple, Path] = {}

    def make(arch: str = "qwen3", fmt: str = "mlx", seed: int = 0, **kw) -> Path:
        key = (arch, fmt, seed, tuple(sorted(kw.items())))
        if key not in made:
            name = "-".join([arch, str(seed), *(f"{k}{v}" for k, v in sorted(kw.items()))])
            out = root / (f"{name}.gguf" if fmt == "gguf" else name)
            made[key] = generate_tiny_model(out, arch=arch, seed=seed, fmt=fmt, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_hf_tokenizer(tmp_path_factory):
    """The tiny model's tokenizer and chat template through transformers (no MLX)."""
    from transformers import PreTrainedTokenizerFast

    from switchyard.twins.tokenizer import tokenizer_files

    path = tmp_path_factory.mktemp("tok")
    for name, data in tokenizer_files().items():
        (path / name).write_bytes(data)
    return PreTrainedTokenizerFast.from_pretrained(str(path))
