"""`switchyard serve` with a restart policy made for fault drills (many kills in a short time).

    python -m switchyard.testing.drill_serve serve [settings flags]
    ServerGroup(model, entry=DRILL_SERVE, ...)

The real supervisor gives up after more than 5 crashes of a component within 60 s and doubles
its backoff with each crash in a row (deploy/restart_policy.py): right for a real server, but a
drill that kills the kvstore 100 times would end the group or wait minutes per kill. This runs
exactly `deploy.cli serve` (same settings, runtime-dir claim, logging, children) with only the
policy replaced: a fixed short backoff and no give-up within any drill's length.
"""

from __future__ import annotations

import functools
import sys

from switchyard.deploy import cli
from switchyard.deploy.restart_policy import RestartPolicy
from switchyard.deploy.supervisor import Supervisor

DRILL_SERVE = ("switchyard.testing.drill_serve", "serve")
DRILL_POLICY = RestartPolicy(initial_delay_s=0.2, max_delay_s=0.2, factor=1.0,
                             max_crashes=10_000, window_s=60.0, stable_after_s=30.0)


def main(argv: list[str] | None = None) -> int:
    cli.Supervisor = functools.partial(Supervisor, policy=DRILL_POLICY)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
