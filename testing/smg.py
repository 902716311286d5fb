"""SMG (Shepherd Model Gateway, `pip install smg`), installed as its users install it and run in
front of servers:

    smg = install()                                  # pip, into <cache dir>/smg-venv; or raise
    with SmgRouter(smg, [a.url, b.url]) as router:   # `smg launch ... --policy cache_aware`
        openai.OpenAI(base_url=router.url + "/v1", ...)

The venv lives in a per-machine cache directory (`~/.cache/switchyard/smg-venv/`, never the
repository), refreshed daily to the version pip gives on the day, like the agent clients.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import venv
from pathlib import Path

import httpx

from switchyard.common.settings import user_cache_dir
from switchyard.testing.agent_clients import last_error_line
from switchyard.testing.group import free_port

REFRESH_S = 24 * 3600  # an install older than this is refreshed (pip install --upgrade)


class SmgUnavailable(Exception):
    """SMG could not be installed here (no pip, no index); the message says why."""


def smg_venv() -> Path:
    return Path(os.environ.get("SWITCHYARD_SMG_VENV") or user_cache_dir() / "smg-venv")


def install(refresh_s: float = REFRESH_S, timeout_s: float = 600.0) -> Path:
    """Install (or refresh, when older than `refresh_s`) SMG with pip into smg_venv(); return
    its `smg` executable. Raises SmgUnavailable with the reason."""
    root = smg_venv()
    exe = root / "bin" / "smg"
    stamp = root / ".installed"
    if exe.exists() and stamp.exists() and time.time() - stamp.stat().st_mtime < refresh_s:
        return exe
    try:
        if not (root / "bin" / "python").exists():
            venv.create(root, with_pip=True)
        done = subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", "--upgrade", "smg"],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SmgUnavailable(f"pip install smg failed: {exc}") from None
    if done.returncode != 0:
        raise SmgUnavailable(f"pip install smg failed: {last_error_line(done)}")
    if not exe.exists():
        raise SmgUnavailable("pip installed smg without its `smg` command")
    stamp.touch()
    return exe


def version(exe: Path) -> str:
    python = exe.parent / "python"
    done = subprocess.run([str(python), "-m", "pip", "show", "smg"], capture_output=True,
                          text=True, timeout=60)
    return next((ln.split(":", 1)[1].strip() for ln in done.stdout.splitlines()
                 if ln.startswith("Version:")), "?")


class SmgRouter:
    """`smg launch` in front of `worker_urls`, on a free port; its log in `log_path`."""

    def __init__(self, exe: Path, worker_urls: list[str], log_path: Path, *,
                 policy: str = "cache_aware", extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # SMG's Prometheus listener defaults to 0.0.0.0:29000: one of its own, on loopback, so
        # that two routers (two test files, a bench) run side by side.
        self.cmd = [str(exe), "launch", "--worker-urls", *worker_urls, "--policy", policy,
                    "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "SmgRouter":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        raise RuntimeError(f"smg not ready in {timeout_s:.0f}s:\n{self.log_tail()}")

    def ready(self) -> bool:
        """SMG answers /v1/models with its registered workers' models once they are in."""
        try:
            models = httpx.get(self.url + "/v1/models", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return bool(models.get("data")) if isinstance(models, dict) else False

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 2 s: on SIGTERM SMG drains for its shutdown grace period
        (the unit's 20 s), and a stopped test holds no request worth draining."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "SmgRouter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # install by hand: python -m switchyard.testing.smg
    print(install(), file=sys.stdout)
