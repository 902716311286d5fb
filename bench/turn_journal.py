"""A restarted gateway remembers the turns in use, at a bounded write cost.

    .venv/bin/python bench/turn_journal.py

No servers: the gateway's `TurnMemory` with its journal in a temporary runtime dir, driven like
a fleet of agents that resend their whole history with every request (each earlier reply looked
up, then one new reply remembered). Midway a second memory loads the journal, as a restarted
gateway does. Reported per scenario: turns remembered, lookups, "used" and "forgotten" records
written over the run (and their bytes against the turn records'), the turns the old memory
held, and how many of them the restarted one has; then the same requests go on in the old
memory and the restarted one: earlier replies found by each (the order the turns loaded in
decides which the next turns push out); "append order" is what loading the last
`--history-turns` remembered (the journal's first format) would have kept. The long-lived
agents' turns restored is the figure that matters: their next prompt diverges at the first one
missing (docs/design/requests.md "Prefix-stable history"). Target: all of them; used records <= 2 per
turn remembered + max_turns.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from switchyard.gateway.prompting import turn_journal as tj  # noqa: E402
from switchyard.gateway.prompting.history import TurnMemory  # noqa: E402
from switchyard.gateway.prompting.turn_keys import message_key  # noqa: E402

IDENTITY = b"bench-identity16"
BODY = list(range(200))  # tokens per reply


def reply(name: str) -> dict:
    return {"role": "assistant", "content": f"reply {name}"}


def round_robin(agents: int, turns: int) -> Iterator[tuple[str, int]]:
    for t in range(turns):
        for a in range(agents):
            yield f"agent{a}", t


def long_among_short(long_agents: int, rounds: int, short_turns: int
                     ) -> Iterator[tuple[str, int]]:
    """Long tool loops that run all along, while short-lived agents come and go."""
    for r in range(rounds):
        for a in range(long_agents):
            yield f"long{a}", r
        for t in range(short_turns):
            yield f"short{r}", t


class CountingJournal(tj.TurnJournal):
    """The gateway's journal, counting the small records it writes over the run (a rewrite
    drops them from the file)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.used = self.forgotten = self.rewrites = 0

    def mark_used(self, placed):
        super().mark_used(placed)
        self.used += 1

    def forget(self, placed):
        super().forget(placed)
        self.forgotten += 1

    def rewrite(self, live):
        self.rewrites += 1
        return super().rewrite(live)


def serve(memory: TurnMemory, requests: list[tuple[str, int]]) -> tuple[int, int]:
    """Each request: its earlier replies looked up, then its reply remembered; (lookups, found)."""
    lookups = found = 0
    for agent, t in requests:
        for earlier in range(t):
            found += memory.lookup(reply(f"{agent}-{earlier}")) is not None
            lookups += 1
        memory.remember(reply(f"{agent}-{t}"), BODY, None, False)
    return lookups, found


def run(name: str, requests: list[tuple[str, int]], restart_at: int, max_turns: int) -> None:
    with tempfile.TemporaryDirectory() as runtime_dir:
        journal = CountingJournal.in_dir(Path(runtime_dir), IDENTITY)
        memory = TurnMemory(max_turns, journal=journal)
        before, after = requests[:restart_at], requests[restart_at:]
        lookups, _ = serve(memory, before)
        appended = [f"{agent}-{t}" for agent, t in before]
        used, forgotten = journal.used, journal.forgotten
        small_bytes = (used + forgotten) * len(tj._frame(tj.Used(journal.max_bytes)))
        turn_bytes = len(appended) * len(tj._frame(tj.TurnRecord("0" * 32, "[]", [], bytes(
            4 * len(BODY)), None, False)))
        held = {turn.key for turn in memory._turns.values()}
        again = TurnMemory(max_turns, journal=tj.TurnJournal.in_dir(Path(runtime_dir),
                                                                     IDENTITY))
        restored = {turn.key for turn in again._turns.values()}
        append_order = {message_key(reply(n)) for n in appended[-max_turns:]}
        long_turns = {message_key(reply(n)) for n in appended if n.startswith("long")}
        print(f"{name}, restart after {len(before)} turns remembered ({lookups} lookups), "
              f"max_turns {max_turns}; written: {used} used records "
              f"({used / len(appended):.2f} per turn remembered) and {forgotten} forgotten, "
              f"<= {small_bytes} bytes together = {small_bytes / turn_bytes:.1%} of the turn "
              f"records' bytes; {journal.rewrites} rewrites")
        print(f"  held by the old memory {len(held)}; restored: {len(held & restored)} of them"
              f" (append order: {len(held & append_order)})")
        if long_turns:
            print(f"  long-lived agents' turns: {len(long_turns)}; restored "
                  f"{len(long_turns & restored)} (append order: {len(long_turns & append_order)})")
        # the same requests go on, to the old memory (as if never restarted; its journal
        # closed) and to the restarted one: the order the turns loaded in decides which go
        memory.journal.close()
        lookups_after, found_old = serve(memory, after)
        _, found_new = serve(again, after)
        print(f"  the next {len(after)} requests ({lookups_after} lookups): found by the old "
              f"memory {found_old}, by the restarted one {found_new}")
        assert used <= 2 * len(appended) + max_turns and restored == held


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    run("8 agents x 200 turns, round robin", list(round_robin(8, 200)), 8 * 150, 1024)
    run("2 long agents x 300 turns among 10-turn agents", list(long_among_short(2, 300, 10)),
        12 * 250, 1024)


if __name__ == "__main__":
    main()
