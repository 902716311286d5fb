"""Restart drill figures: time to recover for each component, requests failed, tokens re-read.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/restart_drill.py

Three conversations are served continuously (each turn adds a ~250-word tool result); the
worker, kvstore, scheduler and gateway are killed with SIGKILL one after another.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from switchyard.testing.drill import run_drill  # noqa: E402
from switchyard.testing.group import ServerGroup  # noqa: E402


def main() -> None:
    from fixtures.tiny_models import generate_tiny_model

    model = generate_tiny_model(Path(tempfile.mkdtemp(prefix="sydrill")) / "m", "qwen3")
    with ServerGroup(model, slots=2, ctx=16384) as group:
        result = run_drill(group, turns=3)
    print(f"{'component':10} {'recover_s':>9} {'ok':>4} {'failed':>6}  {'re-read':>7}  failures")
    for row in result.report():
        print(f"{row['role']:10} {row['recovery_s']!s:>9} {row['requests_ok']:>4} "
              f"{row['requests_failed']:>6}  {row['tokens_reread']:>7}  "
              f"{', '.join(row['failures']) or '-'}")


if __name__ == "__main__":
    main()
