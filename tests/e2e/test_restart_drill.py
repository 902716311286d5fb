"""The restart drill: kill -9 each component in turn while three conversations are
served. The supervisor restarts it; every request completes or gets one retryable error (or,
when the gateway itself dies, loses its connection); afterwards every conversation's next
turn finds its prefix again; no process outside the group is ever signalled."""

from __future__ import annotations

import subprocess
import sys

from switchyard.testing.drill import run_drill
from switchyard.testing.group import ServerGroup


def test_kill_each_component_while_serving(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=2, ctx=16384) as group:
        # A decoy whose command line names the runtime dir and every role: never signalled.
        decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                  str(group.runtime_dir), "gateway", "scheduler", "worker",
                                  "kvstore", "switchyard.deploy.cli"])
        try:
            result = run_drill(group)
            assert decoy.poll() is None, "a process outside the group was signalled"
        finally:
            decoy.kill()
    rows = {row["role"]: row for row in result.report()}
    print(rows)
    for outcome in result.outcomes:
        assert outcome.status in (200, 503, None), outcome
        if outcome.status == 503:
            assert outcome.retry_after, "a 503 says when to retry"
    for role, row in rows.items():
        assert row["recovery_s"] is not None, f"nothing succeeded after the {role} restart"
        assert row["requests_ok"] >= 1
        if role != "gateway":
            assert all(o.status is not None for o in result.after(result.kills[0][1])
                       if o.status != 200 and _in_window(result, role, o)), \
                f"only a dying gateway may drop connections ({role})"
    for conv in range(3):
        last = [o for o in result.outcomes if o.conversation == conv and o.status == 200][-1]
        assert last.cached_tokens >= last.prompt_tokens - last.new_tokens - 256, last


def _in_window(result, role, outcome) -> bool:
    times = {r: t for r, t, _ in result.kills}
    later = [t for r, t, _ in result.kills if t > times[role]]
    return times[role] <= outcome.ended < (min(later) if later else float("inf"))
