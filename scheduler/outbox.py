"""The scheduler's one outbox: what handling an event sends and logs, in order.

The core owns it and hands it to the page cache and to the rank fan-out (page_stores), so
every message and log line of the scheduler goes through one object; the shell takes what it
holds after each event as one `Effects` and carries it out (docs/design/scheduling.md "Scheduling").
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.proto.scheduler_worker import RunStep
from switchyard.scheduler.events import Effects


@dataclass(frozen=True)
class Addressed:
    """A message for one peer by its identity (a rank's kvstore), not routed by type."""

    to: str
    message: object


class Outbox:
    def __init__(self) -> None:
        self._messages: list = []
        self._logs: list[tuple[str, dict]] = []
        self._finished: list = []

    def send(self, message) -> None:
        """A message to its peer, routed by type (scheduler/service.py)."""
        self._messages.append(message)

    def send_first(self, *messages) -> None:
        """Messages that must reach their peer before anything queued so far: a kvstore needs
        the worker's buffers (AttachBuffers) before the first read or write that uses them."""
        self._messages[:0] = messages

    def send_to(self, identity: str, message) -> None:
        self._messages.append(Addressed(identity, message))

    def log(self, event: str, **fields) -> None:
        """A log line (fields only, never text), logged by the shell."""
        self._logs.append((event, fields))

    def finished(self, record) -> None:
        """A request ended: its FinishedRecord, recorded and logged by the shell."""
        self._finished.append(record)

    def take(self, step: RunStep | None = None) -> Effects:
        """Everything held, emptied."""
        effects = Effects(self._messages, self._logs, self._finished, step)
        self._messages, self._logs, self._finished = [], [], []
        return effects
