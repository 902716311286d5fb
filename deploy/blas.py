"""OpenBLAS for the worker on Linux.

MLX's Linux CPU wheel ships a reference BLAS; Debian's OpenBLAS (package libopenblas0-pthread)
loaded with LD_PRELOAD makes float32 matmul about 30x faster. The worker re-executes itself with
it preloaded when the library is there, and logs `worker.blas_missing` (naming the package)
when it is not. `python -m switchyard.deploy.blas` prints the library's path (or
nothing) for shell scripts (deploy/dev.sh).
"""

from __future__ import annotations

import platform
import sys
import sysconfig
from pathlib import Path

REEXEC_ENV = "SWITCHYARD_BLAS_REEXEC"
BLAS_PACKAGE = "libopenblas0-pthread"  # Debian/Ubuntu; without it the worker warns at start
# OpenBLAS's idle threads spin for 2^28 cycles (about 0.1 s) after every product, taking the
# cores the worker's split attention streams run on (worker/cpu_attention.py); 2^4 cycles
# makes them wait on a condition instead. Measured on 2 cores with the split: prefill at 4K of
# context 54 -> 64 tokens/s, a cold prompt 151 -> 175, decode unchanged. Set only where unset.
THREAD_TIMEOUT = ("OPENBLAS_THREAD_TIMEOUT", "4")


def openblas_path() -> Path | None:
    """Debian/Ubuntu's pthread OpenBLAS (`/usr/lib/<multiarch>/openblas-pthread/libblas.so.3`)."""
    if not sys.platform.startswith("linux"):
        return None
    names = [sysconfig.get_config_var("MULTIARCH") or "", f"{platform.machine()}-linux-gnu"]
    for multiarch in dict.fromkeys(n for n in names if n):
        path = Path("/usr/lib") / multiarch / "openblas-pthread" / "libblas.so.3"
        if path.exists():
            return path
    return None


def preload_env(env: dict[str, str], lib: Path) -> dict[str, str] | None:
    """`env` with `lib` in LD_PRELOAD and OpenBLAS's thread timeout set where it is unset and
    OpenBLAS may run more than one thread; None if `env` already has both."""
    current = env.get("LD_PRELOAD", "")
    entries = [e for e in current.replace(" ", ":").split(":") if e]
    preloaded = str(lib) in entries or any(Path(e).resolve() == lib.resolve() for e in entries)
    name, value = THREAD_TIMEOUT
    idle_threads = env.get("OPENBLAS_NUM_THREADS", "").strip() != "1"
    if preloaded and (name in env or not idle_threads):
        return None
    new = {name: value, **env} if idle_threads else dict(env)
    if not preloaded:
        new["LD_PRELOAD"] = ":".join([str(lib), *entries])
    return new


if __name__ == "__main__":
    found = openblas_path()
    if found:
        print(found)
