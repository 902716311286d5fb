"""`switchyard status [--json] [--runtime-dir DIR]`: what one group is doing now.

Components are found by their pid files in the runtime directory (never by name:
docs/design.md "Processes"); uptimes come from /proc/<pid>/stat on Linux or `ps -o etimes= -p
PID` elsewhere. Slots, queue, disk usage and counters come from `status.json` (proto/status.py),
which the scheduler rewrites every heartbeat.
Exit status: 0 when a group runs there, 1 when none does.

    report = collect(runtime_dir)   # I/O
    print(format_report(report))    # pure
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from switchyard.deploy.runtime import pid_alive, read_pid_file
from switchyard.deploy.supervisor import ROLES
from switchyard.common.endpoints import Endpoints
from switchyard.common.settings import Settings, format_size
from switchyard.proto.status import (TOKEN_KINDS, PrefillShareStatus, SpeculationStatus, Status,
                                     TokenCounts, read_status)

EXIT_NOT_RUNNING = 1
STALE_AFTER_S = 10.0  # a status.json older than this is reported as stale


# -- collecting (I/O) ----------------------------------------------------------------------------

def uptime_s(pid: int) -> float | None:
    """Seconds since `pid` started, or None if that cannot be told."""
    if sys.platform.startswith("linux"):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            boot_uptime = float(Path("/proc/uptime").read_text().split()[0])
        except (OSError, ValueError):
            return None
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
        return max(0.0, boot_uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    for field in ("etimes=", "etime="):  # macOS's ps knows only etime ([[dd-]hh:]mm:ss)
        try:
            out = subprocess.run(["ps", "-o", field, "-p", str(pid)], capture_output=True,
                                 text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        seconds = parse_etime(out.stdout.strip()) if out.returncode == 0 else None
        if seconds is not None:
            return seconds
    return None


def parse_etime(text: str) -> float | None:
    """`ps` elapsed time: plain seconds (etimes) or [[dd-]hh:]mm:ss (etime)."""
    if text.isdigit():
        return float(text)
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not (days.isdigit() or not days) or not 2 <= len(parts) <= 3 or not all(
            p.isdigit() for p in parts):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return float(seconds + 86400 * int(days or 0))


_RANK_ROLE = re.compile(r"(worker|kvstore)\.[1-9][0-9]*")


def collect(runtime_dir: Path, now: float | None = None) -> dict:
    endpoints = Endpoints(runtime_dir)
    components = {}
    # A worker group's other local ranks (worker.R, kvstore.R) have pid files of their own.
    ranks = sorted((p.name[:-len(".pid")] for p in Path(runtime_dir).glob("*.*.pid")
                    if _RANK_ROLE.fullmatch(p.name[:-len(".pid")])),
                   key=lambda role: (int(role.rpartition(".")[2]), role))
    for role in ("supervisor", *ROLES, *ranks):
        pid = read_pid_file(endpoints.pid_file(role))
        alive = pid is not None and pid_alive(pid)
        components[role] = {"pid": pid, "alive": alive,
                            "uptime_s": uptime_s(pid) if alive else None}
    snapshot = read_status(endpoints.status_file)
    now = time.time() if now is None else now
    return {"runtime_dir": str(runtime_dir), "at": now,
            "running": any(c["alive"] for c in components.values()),
            "components": components, "snapshot": snapshot,
            "snapshot_age_s": now - snapshot.at if snapshot is not None else None}


# -- formatting (pure) ---------------------------------------------------------------------------

def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(max(0, seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    table = [header, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]


def format_components(report: dict) -> list[str]:
    snapshot: Status | None = report.get("snapshot")
    boots = {} if snapshot is None else {
        "scheduler": snapshot.boot_id, **{role: p.boot_id for role, p in snapshot.peers.items()}}
    rows = []
    for role, info in report["components"].items():
        if info["pid"] is None:
            state = "no pid file"
        else:
            state = "running" if info["alive"] else "not running (stale pid file)"
        boot = boots.get(role)
        rows.append([role, str(info["pid"] or "-"), state, format_duration(info["uptime_s"]),
                     boot or "-"])
    return ["components"] + _table(["role", "pid", "state", "up", "boot id"], rows)


def format_slots(snapshot: Status, now: float) -> list[str]:
    """With several keys, a column says whose each slot's text is (this command reads the
    runtime dir: it is the operator's view)."""
    tenants = any(slot.tenant for slot in snapshot.slots)
    rows = []
    for slot in snapshot.slots:
        last = slot.last_used
        rows.append([str(slot.slot), slot.state, slot.conversation or "-",
                     f"{slot.num_tokens:,}",
                     format_duration(now - last) + " ago" if last else "-",
                     slot.priority or "-"] + ([slot.tenant or "-"] if tenants else []))
    header = ["slot", "state", "conversation", "tokens", "last use", "priority"]
    return [f"slots ({len(rows)})"] + _table(header + (["tenant"] if tenants else []), rows)


def format_queue(snapshot: Status) -> list[str]:
    queue = snapshot.queue
    oldest = f"oldest request without its first token: {snapshot.oldest_waiting_s:.1f}s"
    if not queue:
        return ["queue: empty", oldest]
    rows = [[q.rid, q.priority, f"{q.prompt_tokens:,}", f"{q.waiting_s:.1f}s"] for q in queue]
    return [f"queue: {len(queue)} waiting"] + _table(
        ["request", "priority", "prompt tokens", "waiting"], rows) + [oldest]


def format_kv_memory(snapshot: Status) -> list[str]:
    """The KV the slots hold against the worker's budget (docs/design/kv-pages.md "Memory plan")."""
    kv = snapshot.kv_memory
    if kv is None:
        return []
    share = f" ({100 * kv.held_tokens / kv.budget_tokens:.1f}%)" if kv.budget_tokens else ""
    shelved = (f", {kv.num_shelved} shelved as {kv.shelved_tokens:,} tokens of shared pages"
               if kv.num_shelved else "")
    cut = (f", {kv.num_cut:,} cut for memory keeping {kv.cut_kept_tokens:,} tokens"
           if kv.num_cut else "")
    return [f"kv memory: {kv.held_tokens:,} of {kv.budget_tokens:,} tokens held{share} "
            f"(with growth reserves; {kv.num_tokens:,} tokens in {kv.num_resident} slots, "
            f"{kv.num_running} running{shelved}), {kv.num_preempted:,} staged to disk for "
            f"memory{cut}"]


def format_disk(snapshot: Status) -> list[str]:
    disk = snapshot.disk
    used, budget = disk.bytes, disk.budget_bytes
    share = f" ({100 * used / budget:.1f}%)" if budget else ""
    line = (f"disk cache: {format_size(used)} of {format_size(budget)} budget{share}, "
            f"{disk.num_pages:,} pages, {disk.num_evicted:,} evicted, "
            f"{disk.num_thrash:,} thrash events")
    if not disk.writable:
        line += ", writes paused"
    lines = [line]
    if disk.error:
        lines.append(f"  disk writes refused: {disk.error}")
    if disk.num_unwritten:
        lines.append(f"  {disk.num_unwritten:,} pages not written (not cached; pages on disk "
                     f"are kept)")
    return lines


def format_peers(snapshot: Status) -> list[str]:
    """The --peer servers and the pages fetched from each (docs/design/kv-pages.md "Pages
    from a peer")."""
    peers = snapshot.peer_servers
    if not peers:
        return []
    rows = [[p.url, f"{p.num_asks:,}", f"{p.num_pages:,}", format_size(p.num_bytes),
             f"{p.fetch_s:.2f}s", f"{p.num_failures:,}", p.last_error[:60]] for p in peers]
    return [f"peers: {len(peers)} (pages fetched from each)"] + _table(
        ["peer", "asks", "pages", "bytes", "time", "failures", "last error"], rows)


def format_ranks(snapshot: Status) -> list[str]:
    """A worker group's ranks: host, pool, and each rank's kvstore (state, pages held)."""
    ranks = snapshot.ranks
    if not ranks:
        return []
    rows = [[str(r.rank), r.host, f"{r.num_buffers} x {format_size(r.buffer_bytes)}",
             r.kvstore, r.kvstore_state, f"{r.num_pages:,}"] for r in ranks]
    return [f"worker group: {len(ranks)} ranks"] + _table(
        ["rank", "host", "page buffers", "kvstore", "state", "pages"], rows)


def format_counters(snapshot: Status) -> list[str]:
    stats = snapshot.stats
    finished, failed = stats.requests_finished, stats.requests_failed
    ttft = stats.ttft
    lines = [f"requests: {sum(finished.values())} finished"
             + (f" ({_kv(finished)})" if finished else "")
             + f", {sum(failed.values())} failed" + (f" ({_kv(failed)})" if failed else "")]
    lines.append("tokens: " + "  ".join(f"{k} {getattr(stats.tokens, k):,}"
                                         for k in TOKEN_KINDS))
    lines.append(format_speculation(snapshot.speculation, stats.tokens))
    if snapshot.prefill_share is not None:
        lines.append(format_prefill_share(snapshot.prefill_share))
    if ttft.count:
        lines.append(f"ttft: mean {ttft.sum / ttft.count:.3f}s over {ttft.count}")
    restarts = stats.restarts
    lines.append("restarts seen: " + (_kv(restarts) if restarts else "none"))
    return lines


def format_prefill_share(share: PrefillShareStatus) -> str:
    """The latest step that prefilled beside decoding streams (scheduler/prefill_plan.py)."""
    waiting = f"{share.num_waiting} waiting for a first token" if share.num_waiting \
        else "no new turn waiting"
    return (f"prefill share: {share.num_protected} decoding stream(s) kept "
            f"{share.decode_share:.2f} of their solo speed beside {waiting} "
            f"({share.age_s:.0f}s ago)")


def format_speculation(speculation: SpeculationStatus | None, tokens: TokenCounts) -> str:
    if speculation is None or speculation.mode == "off":
        return "speculative decoding: off"
    proposed, accepted = tokens.draft_proposed, tokens.draft_accepted
    where = "every decoding sequence" if speculation.mode == "batched" \
        else "a lone decoding sequence"
    rate = f" ({accepted / proposed:.0%})" if proposed else ""
    whose = {"suffix": "copied from the conversations", "draft": "from the draft model",
             "suffix,draft": "copied, else from the draft model",
             "mtp": "from the model's MTP head",
             "suffix,mtp": "copied, else from the model's MTP head"}
    whose = whose.get(speculation.proposers, speculation.proposers)
    return (f"speculative decoding: {where}, up to {speculation.max_draft_tokens} "
            f"draft tokens {whose}; {proposed:,} proposed, {accepted:,} accepted{rate}")


def _kv(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def format_report(report: dict) -> str:
    where = report["runtime_dir"]
    if not report["running"]:
        return (f"no Switchyard group is running in {where} (no live pid files). Start one "
                f"with `switchyard serve`, or point --runtime-dir at its runtime directory.")
    lines = [f"Switchyard group in {where}"]
    lines += format_components(report)
    snapshot = report.get("snapshot")
    age = report.get("snapshot_age_s")
    if snapshot is None:  # none yet, or one of another version
        lines.append("no status.json yet: the scheduler writes it every heartbeat")
        return "\n".join(lines)
    ready = (f"worker {'ready' if snapshot.worker_ready else 'not ready'}, "
             f"kvstore {'ready' if snapshot.kvstore_ready else 'not ready'}")
    stale = " - STALE: is the scheduler running?" if age is not None and age > STALE_AFTER_S else ""
    lines.append(f"status.json {age or 0:.1f}s old; {ready}{stale}")
    lines += format_ranks(snapshot)
    lines += format_slots(snapshot, report["at"])
    lines += format_queue(snapshot)
    lines += format_kv_memory(snapshot)
    lines += format_disk(snapshot)
    lines += format_peers(snapshot)
    lines += format_counters(snapshot)
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------

def add_parser(sub) -> None:
    from switchyard.common.settings import add_arguments

    parser = sub.add_parser("status", help="slots, queue, disk cache and components of a "
                                           "running group (by --runtime-dir)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    add_arguments(parser)  # --runtime-dir, or --config with it


def main(args, settings: Settings) -> int:
    report = collect(settings.runtime_path.expanduser().absolute())
    if args.json:
        print(json.dumps(msgspec.to_builtins(report), indent=2, sort_keys=True))
    else:
        print(format_report(report))
    return 0 if report["running"] else EXIT_NOT_RUNNING
