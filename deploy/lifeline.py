"""No orphans: a supervised component exits when its supervisor is gone, even after SIGKILL.

The supervisor puts its pid in SWITCHYARD_PARENT_PID. The child asks the kernel for SIGTERM
when its parent dies (PR_SET_PDEATHSIG, Linux) and also runs a watchdog thread that notices
getppid() changing (every platform). Either way the component gets SIGTERM, shuts down as it
would under the supervisor, and is hard-exited if it has not finished after a grace period.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_ENV = "SWITCHYARD_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux only: have the kernel send `sig` to this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def parent_pid_from_env() -> int | None:
    text = os.environ.get(PARENT_ENV, "")
    return int(text) if text.isdigit() else None


def watch_parent(parent_pid: int, interval_s: float = 0.5, grace_s: float = 15.0,
                 use_pdeathsig: bool = True) -> None:
    """Exit (SIGTERM to ourselves, then a hard exit after `grace_s`) once `parent_pid` is gone."""
    if use_pdeathsig:
        set_parent_death_signal(signal.SIGTERM)

    def orphaned() -> bool:
        return os.getppid() != parent_pid

    def leave() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    if orphaned():  # the parent died before we could watch it
        os._exit(1)

    def loop() -> None:
        while not orphaned():
            time.sleep(interval_s)
        leave()

    threading.Thread(target=loop, name="parent-watchdog", daemon=True).start()
