"""What the scheduler core takes in and gives out (docs/design/scheduling.md "Scheduling").

The core is closed: the shell hands it one event at a time with the current time
(`SchedulerCore.handle`) and gets back one `Effects`: the messages to send, routed by their
type, the log lines and the finished requests to record. Peer messages that are events
(`SubmitRequest`, `StepDone`, `PagesRead`, ...) are passed as they arrived; what only the shell
can observe (a peer restarted, went silent, a step could not be sent) has its own type here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.proto.gateway_scheduler import CancelRequest, ReplyEnded, SubmitRequest
from switchyard.proto.scheduler_worker import (
    GrammarPrepared,
    RunStep,
    StepDone,
    WorkerReady,
    WorkerStopping,
)
from switchyard.proto.scheduler_kvstore import InventoryDescribed, PagesRead, PagesWritten


@dataclass(frozen=True)
class PlanStep:
    """The worker is ready and idle as far as the shell knows: plan a step if one is due."""


@dataclass(frozen=True)
class GatewayRestarted:
    """The gateway's HTTP requests are gone with it: their requests end, unannounced."""


@dataclass(frozen=True)
class WorkerLost:
    """The worker restarted, went silent, or a step could not be sent to it: the step in
    flight will not come back. Its slots are learnt again from its next `WorkerReady`."""


@dataclass(frozen=True)
class KvstoreRestarted:
    """A new kvstore: reads and writes sent to the old one are lost; attach and inventory."""


@dataclass(frozen=True)
class FailAll:
    """Fail every request with this error (the worker stayed away too long)."""

    code: str
    message: str
    retry_after_s: float


@dataclass(frozen=True)
class IndexOverdue:
    """kvstore's page index is (no longer) long overdue: place requests without it (or wait
    for it again, docs/design.md "Processes")."""

    overdue: bool


Event = (SubmitRequest | CancelRequest | ReplyEnded | StepDone | WorkerReady | GrammarPrepared
         | WorkerStopping | InventoryDescribed | PagesRead | PagesWritten | PlanStep
         | GatewayRestarted | WorkerLost | KvstoreRestarted | FailAll | IndexOverdue)


@dataclass
class Effects:
    """What one event produced, in order."""

    messages: list = field(default_factory=list)  # to peers, routed by type
    logs: list[tuple[str, dict]] = field(default_factory=list)  # (event, fields)
    finished: list = field(default_factory=list)  # FinishedRecord per request that ended
    step: RunStep | None = None  # the step planned by `PlanStep` (also in `messages`)
