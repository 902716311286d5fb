"""Fixtures for end-to-end tests: the whole process group on a tiny generated model.

    def test_chat(group):                        # one group per test module
        client = openai.OpenAI(base_url=group.base_url, api_key="none")

`tiny_qwen3` is the directory of a tiny random-weight qwen3 model, generated once per session.
Every test in tests/e2e is marked `slow`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from switchyard.testing.group import ServerGroup


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from fixtures.tiny_models import generate_tiny_model

    target = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    made = generate_tiny_model(target, "qwen3")
    return Path(made) if made else target


@pytest.fixture(scope="module")
def group(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=4, ctx=4096) as running:
        yield running
