"""Soak under faults: 16 agents for --minutes against --slots 4 while components
are killed, the page disk fills or stops being writable, and page files are corrupted.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/soak.py [--minutes 10] [--seed 12]

Loopback only, bounded in time (--minutes per run) and count (--max-turns per agent); it stops
by itself. Two runs of the same seeded agents:

1. fault-free reference: every agent's replies (greedy) are recorded, per (conversation, turn);
2. under faults: each agent sends the same requests (at most as many turns as it did in the
   reference) while an injector, every --fault-min..--fault-max seconds (seeded), does one of:
   kill -9 of the gateway, scheduler, worker or kvstore (pid files; the supervisor restarts it),
   fill the page disk (the kv dir is a small tmpfs: a filler file takes all free space for a
   while), make the page directories unwritable (chattr +i, root only: chmod does not stop
   root), or flip a byte in a page file.

Agents (index % 16): 0-7 tool loops (the whole history resent each turn, a ~100-word tool
result added), 8-10 the same as `background` priority, 11-13 streaming, and every third turn
first a streamed request dropped after two chunks, 14-15 a malformed body before each turn.
The assistant turns in the history are fixed text, so every request is known in advance.

Checks (exit 1 if one fails): no response other than 2xx, 4xx for the malformed bodies, and
503/429 with Retry-After (retried, as a client would); 0 replies different from the reference;
each conversation's first turn after a kill restores (cached >= prompt - new - one page); page
bytes on disk (sampled every 2 s, kvstore paused for the walk) never above --kv-disk-budget;
gateway and scheduler VmRSS growth over the second half < 5% (same pid); no /dev/shm segment
of the group and no process left after it stops. Corruption and disk faults legitimately lose
pages (and after the disk refused a page, the scheduler and kvstore try again after a backoff
of 1 s doubling to 30 s): a short restore of a conversation under way then is counted as
excused, apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench._common import parse_with_model, table  # noqa: E402
from switchyard.common.backoff import MAX_S  # noqa: E402
from switchyard.common.endpoints import Endpoints  # noqa: E402
from switchyard.testing.drill_serve import DRILL_SERVE  # noqa: E402
from switchyard.testing.group import ServerGroup, short_tmp_dir  # noqa: E402
from switchyard.proto.status import DiskStatus, read_status  # noqa: E402
from switchyard.testing.workload import text, wait_ready  # noqa: E402

PAGE = 256
NUM_AGENTS = 16
KILL_ROLES = ("gateway", "scheduler", "worker", "kvstore")
RETRY_STATUSES = (429, 503)


def agent_kind(index: int) -> str:
    i = index % 16
    return ("tool" if i < 8 else "background" if i < 11 else "stream" if i < 14
            else "malformed")


# --- requests --------------------------------------------------------------------------------


@dataclass
class Record:
    agent: int
    kind: str  # turn | drop | malformed
    key: tuple[int, int] | None  # (conversation, turn) of a turn
    started: float
    ended: float = 0.0
    status: int | None = None  # final status; None: no reply at all
    text: str | None = None
    prompt: int = 0
    cached: int = 0
    retries: int = 0  # 503/429 with Retry-After, connection failures, mid-stream errors
    problems: list[str] = field(default_factory=list)


class Script:
    """An agent's requests, known in advance: conversations of --turns turns."""

    def __init__(self, index: int, seed: int, turns: int, system: str):
        self.index, self.seed, self.turns, self.system = index, seed, turns, system

    def messages(self, conv: int, turn: int) -> list[dict]:
        base = self.seed * 100_000 + self.index * 1000 + conv * 50
        msgs = [{"role": "system",
                 "content": f"{self.system} agent {self.index} conversation {conv}"},
                {"role": "user", "content": text(base, 120)}]
        for t in range(1, turn + 1):
            msgs.append({"role": "assistant", "content": f"step {t} done"})
            msgs.append({"role": "user", "content": "tool result: " + text(base + t, 100)})
        return msgs


def malformed_bodies(model: str) -> list[tuple[bytes, str]]:
    ok = [{"role": "user", "content": "hi"}]
    bodies = [b"{not json", json.dumps({"model": model}).encode(),
              json.dumps({"model": model, "messages": "hello"}).encode(),
              json.dumps({"model": model, "messages": ok, "max_tokens": -5}).encode(),
              json.dumps({"model": model, "messages": [{"role": "wizard",
                                                        "content": "hi"}]}).encode(),
              json.dumps({"model": model, "messages": ok, "temperature": "hot"}).encode(),
              json.dumps([1, 2, 3]).encode()]
    return [(b, "application/json") for b in bodies]


def _reply(data: dict) -> dict:
    details = data["usage"].get("prompt_tokens_details") or {}
    return {"text": data["choices"][0]["message"]["content"],
            "prompt": data["usage"]["prompt_tokens"], "cached": details.get("cached_tokens", 0)}


class Agent(threading.Thread):
    def __init__(self, index: int, script: Script, url: str, model: str, deadline: float,
                 max_turns: int, max_tokens: int, sink: list, lock: threading.Lock):
        super().__init__(daemon=True, name=f"agent-{index}")
        self.index, self.script, self.url, self.model = index, script, url, model
        self.kind = agent_kind(index)
        self.deadline, self.max_turns, self.max_tokens = deadline, max_turns, max_tokens
        self.sink, self.lock = sink, lock
        self.rng = random.Random(script.seed * 7919 + index)
        self.turns_done = 0
        self.give_up_at = deadline + 180  # a turn in flight at the deadline may still retry

    def _add(self, rec: Record) -> None:
        rec.ended = time.monotonic()
        with self.lock:
            self.sink.append(rec)

    def run(self) -> None:
        headers = {"x-switchyard-priority": "background"} if self.kind == "background" else {}
        with httpx.Client(timeout=httpx.Timeout(300, connect=5), headers=headers) as http:
            n = 0
            while n < self.max_turns and time.monotonic() < self.deadline:
                conv, turn = divmod(n, self.script.turns)
                body = {"model": self.model, "messages": self.script.messages(conv, turn),
                        "max_tokens": self.max_tokens, "temperature": 0}
                if self.kind == "malformed":
                    self._malformed(http)
                if self.kind == "stream" and turn % 3 == 2:
                    self._dropped(http, body)
                self._add(self._turn(http, body, (conv, turn)))
                n += 1
                self.turns_done = n

    def _turn(self, http: httpx.Client, body: dict, key) -> Record:
        rec = Record(self.index, "turn", key, time.monotonic())
        stream = self.kind == "stream"
        while time.monotonic() < self.give_up_at:
            try:
                if stream:
                    status, retry_after, reply = self._post_stream(http, body)
                else:
                    resp = http.post(f"{self.url}/v1/chat/completions", json=body)
                    status, retry_after = resp.status_code, resp.headers.get("retry-after")
                    reply = _reply(resp.json()) if status == 200 else None
            except (httpx.TransportError, json.JSONDecodeError):
                rec.retries += 1
                time.sleep(0.5)
                continue
            rec.status = status
            if status in RETRY_STATUSES:
                if retry_after is None:
                    rec.problems.append(f"{status} without Retry-After")
                rec.retries += 1
                time.sleep(min(2.0, float(retry_after or 1)))
                continue
            if status != 200:
                rec.problems.append(f"HTTP {status} for a valid request")
                return rec
            if reply is None:  # an error event mid-stream (a component died): retry
                rec.retries += 1
                time.sleep(0.5)
                continue
            rec.text = reply["text"]
            rec.prompt, rec.cached = reply["prompt"], reply["cached"]
            return rec
        rec.problems.append("gave up retrying")
        return rec

    def _post_stream(self, http: httpx.Client, body: dict):
        body = dict(body, stream=True, stream_options={"include_usage": True})
        with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                return resp.status_code, resp.headers.get("retry-after"), None
            parts, usage, failed = [], None, False
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    failed = True
                for choice in obj.get("choices") or []:
                    parts.append((choice.get("delta") or {}).get("content") or "")
                if obj.get("usage"):
                    usage = obj["usage"]
            if failed or usage is None:
                return 200, None, None
            details = usage.get("prompt_tokens_details") or {}
            return 200, None, {"text": "".join(parts), "prompt": usage["prompt_tokens"],
                               "cached": details.get("cached_tokens", 0)}

    def _dropped(self, http: httpx.Client, body: dict) -> None:
        """A streamed request the client abandons after two chunks."""
        rec = Record(self.index, "drop", None, time.monotonic())
        body = dict(body, stream=True)
        try:
            with http.stream("POST", f"{self.url}/v1/chat/completions", json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code == 200:
                    for i, _ in enumerate(resp.iter_lines()):
                        if i >= 3:
                            break  # leaving the block closes the connection mid-reply
                else:
                    resp.read()
                    if (resp.status_code in RETRY_STATUSES
                            and resp.headers.get("retry-after") is None):
                        rec.problems.append(f"{resp.status_code} without Retry-After")
                    elif resp.status_code not in RETRY_STATUSES:
                        rec.problems.append(f"HTTP {resp.status_code} for a valid request")
        except httpx.TransportError:
            rec.retries += 1
        self._add(rec)

    def _malformed(self, http: httpx.Client) -> None:
        body, ctype = self.rng.choice(malformed_bodies(self.model))
        rec = Record(self.index, "malformed", None, time.monotonic())
        for _ in range(20):
            try:
                resp = http.post(f"{self.url}/v1/chat/completions", content=body,
                                 headers={"content-type": ctype})
            except httpx.TransportError:
                rec.retries += 1
                time.sleep(0.5)
                continue
            rec.status = resp.status_code
            if resp.status_code in RETRY_STATUSES:
                if resp.headers.get("retry-after") is None:
                    rec.problems.append(f"{resp.status_code} without Retry-After")
                rec.retries += 1
                time.sleep(1.0)
                continue
            if not 400 <= resp.status_code < 500:
                rec.problems.append(f"HTTP {resp.status_code} for a malformed body")
            break
        self._add(rec)


def run_agents(group: ServerGroup, args, seconds: float, max_turns: dict[int, int] | None):
    model = httpx.get(f"{group.base_url}/models").json()["data"][0]["id"]
    system = text(args.seed, 150)
    records: list[Record] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    agents = [Agent(i, Script(i, args.seed, args.turns, system), group.url, model, deadline,
                    (max_turns or {}).get(i, args.max_turns), args.max_tokens, records, lock)
              for i in range(NUM_AGENTS)]
    for a in agents:
        a.start()
    return agents, records


# --- faults ----------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    detail: str
    started: float
    ended: float = 0.0


class Injector(threading.Thread):
    def __init__(self, group: ServerGroup, kv_dir: Path, rng: random.Random, args,
                 deadline: float, tmpfs: bool):
        super().__init__(daemon=True, name="injector")
        self.group, self.kv_dir, self.rng, self.args = group, kv_dir, rng, args
        self.deadline, self.tmpfs = deadline, tmpfs
        self.t0 = time.monotonic()
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.kinds = [k for k in ["kill", "kill", "kill", "corrupt", "readonly", "disk_full"]
                      if k in args.faults.split(",") and (k != "disk_full" or tmpfs)]
        self.roles = [r for r in KILL_ROLES if r in args.kill_roles.split(",")]

    def run(self) -> None:
        while not self.stop.is_set():
            wait = self.rng.uniform(self.args.fault_min, self.args.fault_max)
            if time.monotonic() + wait > self.deadline - 10 or self.stop.wait(wait):
                return
            kind = self.rng.choice(self.kinds)
            fault = Fault(kind, "", time.monotonic())
            try:
                getattr(self, f"_{kind}")(fault)
            except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
                self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
            fault.ended = time.monotonic()
            self.faults.append(fault)
            print(f"  fault {fault.kind} {fault.detail} at {fault.started - self.t0:.0f}s "
                  f"({fault.ended - fault.started:.1f}s)",
                  flush=True)

    def _kill(self, fault: Fault) -> None:
        role = self.rng.choice(self.roles)
        fault.kind = f"kill {role}"
        old = self.group.kill(role)
        new = self.group.wait_restarted(role, old)
        wait_ready(self.group, role, new)
        fault.detail = f"pid {old} -> {new}"

    def _corrupt(self, fault: Fault) -> None:
        pages = sorted(self.kv_dir.rglob("*.page"))
        if not pages:
            fault.detail = "no page yet"
            return
        path = self.rng.choice(pages)
        # In place, never O_CREAT: a page evicted meanwhile must not come back as a file
        # nothing accounts for (it would count against the budget in the disk samples).
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fault.detail = "page evicted meanwhile"
            return
        try:
            at = os.fstat(fd).st_size - 100
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
        finally:
            os.close(fd)
        fault.detail = path.name[:12]

    def _hold(self) -> None:
        self.stop.wait(self.rng.uniform(10, 25))

    def _readonly(self, fault: Fault) -> None:
        dirs = [str(self.kv_dir)] + [str(p) for p in self.kv_dir.rglob("*") if p.is_dir()]
        subprocess.run(["chattr", "+i", *dirs], check=True, capture_output=True)
        try:
            self._hold()
        finally:
            subprocess.run(["chattr", "-i", *dirs], check=True, capture_output=True)
        fault.detail = f"{len(dirs)} dirs"

    def _disk_full(self, fault: Fault) -> None:
        filler = self.kv_dir / "filler.bin"
        chunk = b"\0" * (1 << 20)
        written = 0
        try:
            with open(filler, "wb") as f:
                while True:
                    try:
                        f.write(chunk)
                        f.flush()
                        written += len(chunk)
                    except OSError:
                        break
            self._hold()
        finally:
            filler.unlink(missing_ok=True)
        fault.detail = f"{written >> 20} MiB filler"


# --- samplers --------------------------------------------------------------------------------


def page_bytes(kv_dir: Path) -> int:
    total = 0
    for path in kv_dir.rglob("*.page"):
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def page_bytes_at_one_instant(group: ServerGroup, kv_dir: Path) -> int:
    """Page bytes on disk as they were at one instant. Only kvstore writes or deletes page
    files, and it deletes what the scheduler evicts just before writing what made room for:
    a walk of the directory while it runs can count an evicted page and then the page written
    after it, one page more than was ever on disk (seen as +0.3-1.0 MB samples with the
    scheduler's own count under budget). So kvstore is stopped (SIGSTOP) for the walk, a
    few milliseconds; a rename is atomic, so it stops between whole pages."""
    try:
        pid = group.pid_of("kvstore")
    except (LookupError, ProcessLookupError, OSError):
        return page_bytes(kv_dir)  # restarting: it writes nothing until it has scanned
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return page_bytes(kv_dir)
    try:
        return page_bytes(kv_dir)
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def vm_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    def __init__(self, group: ServerGroup, kv_dir: Path):
        super().__init__(daemon=True, name="sampler")
        self.group, self.kv_dir = group, kv_dir
        self.disk: list[tuple[float, int]] = []
        # What the scheduler counts at each sample (status.json, written every few seconds):
        # tells an accounting error from files nothing accounts for.
        self.counted: list[DiskStatus | None] = []
        self.rss: dict[str, list[tuple[float, int, int]]] = {"gateway": [], "scheduler": []}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(2.0):
            now = time.monotonic()
            self.disk.append((now, page_bytes_at_one_instant(self.group, self.kv_dir)))
            status = read_status(self.group.runtime_dir / "status.json")
            self.counted.append(status.disk if status is not None else None)
            for role, samples in self.rss.items():
                try:
                    pid = self.group.pid_of(role)
                except (LookupError, ProcessLookupError, OSError):
                    continue
                kib = vm_rss_kib(pid)
                if kib:
                    samples.append((now, pid, kib))


WARM_UP_S = 30.0  # a process restarted in the second half is judged from this long after


def rss_growth(samples: list[tuple[float, int, int]], t0: float, t1: float):
    """Growth over the second half of [t0, t1], for the pid that lived longest in it. A pid
    first seen after the half began (killed and restarted there) is judged from WARM_UP_S
    after it was first seen: loading its tokenizer and first requests are not a leak."""
    mid = (t0 + t1) / 2
    first_seen: dict[int, float] = {}
    for t, pid, _ in samples:
        first_seen.setdefault(pid, t)
    by_pid: dict[int, list[int]] = {}
    for t, pid, kib in samples:
        start = mid if first_seen[pid] <= mid else first_seen[pid] + WARM_UP_S
        if t >= start:
            by_pid.setdefault(pid, []).append(kib)
    by_pid = {pid: series for pid, series in by_pid.items() if len(series) >= 4}
    if not by_pid:
        return None
    pid, series = max(by_pid.items(), key=lambda kv: len(kv[1]))
    # The median of the first and last few samples (allocator noise is not growth).
    k = max(1, min(3, len(series) // 4))
    first, last = sorted(series[:k])[k // 2], sorted(series[-k:])[k // 2]
    return pid, first, last, (last - first) / first, len(series)


# --- the runs --------------------------------------------------------------------------------


def group_for(model: Path, args, kv_dir: Path) -> ServerGroup:
    return ServerGroup(model, slots=args.slots, ctx=args.ctx, kv_dir=kv_dir, entry=DRILL_SERVE,
                       extra=["--kv-disk-budget", args.kv_disk_budget])


def mount_tmpfs(path: Path, size: str) -> bool:
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                        str(path)], check=True, capture_output=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


def shm_segments(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def parse_size(s: str) -> int:
    from switchyard.common.settings import parse_size as parse

    return parse(s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each run")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation")
    ap.add_argument("--max-turns", type=int, default=200, help="turns per agent, at most")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--kv-disk-budget", default="160MiB")
    ap.add_argument("--kv-disk-size", default="224m", help="size of the tmpfs kv dir")
    ap.add_argument("--fault-min", type=float, default=30.0)
    ap.add_argument("--fault-max", type=float, default=90.0)
    ap.add_argument("--faults", default="kill,corrupt,readonly,disk_full",
                    help="fault kinds to draw from (kill is drawn 3x as often as the others)")
    ap.add_argument("--kill-roles", default=",".join(KILL_ROLES))
    ap.add_argument("--log-out", type=Path, help="keep the faulted run's group log here")
    args, model = parse_with_model(ap)
    seconds = args.minutes * 60
    budget = parse_size(args.kv_disk_budget)
    started = time.monotonic()

    # 1. Fault-free reference.
    ref_kv = short_tmp_dir("sykvref")
    try:
        with group_for(model, args, ref_kv) as group:
            agents, ref_records = run_agents(group, args, seconds, None)
            for a in agents:
                a.join()
            ref_turns = {a.index: a.turns_done for a in agents}
    finally:
        shutil.rmtree(ref_kv, ignore_errors=True)
    reference = {(r.agent, r.key): r.text for r in ref_records
                 if r.kind == "turn" and r.text is not None}
    print(f"reference: {len(reference)} replies, {sum(ref_turns.values())} turns in "
          f"{time.monotonic() - started:.0f}s", flush=True)

    # 2. The same requests under faults.
    kv_dir = short_tmp_dir("sykvsoak")
    tmpfs = mount_tmpfs(kv_dir, args.kv_disk_size)
    stop_problem = ""
    leaked_shm: list[str] = []
    try:
        group = group_for(model, args, kv_dir)
        group.start()
        prefix = Endpoints(group.runtime_dir).shm_prefix
        try:
            t0 = time.monotonic()
            sampler = Sampler(group, kv_dir)
            sampler.start()
            agents, records = run_agents(group, args, seconds, ref_turns)
            injector = Injector(group, kv_dir, random.Random(args.seed), args, t0 + seconds,
                                tmpfs)
            injector.start()
            for a in agents:
                a.join()
            injector.stop.set()
            injector.join()
            t1 = time.monotonic()
            sampler.stop.set()
            sampler.join()
            corrupt_events = group.log_events("kv.corrupt_page")
        finally:
            if args.log_out:
                shutil.copyfile(group.log_path, args.log_out)
            try:
                group.stop()
            except AssertionError as exc:
                stop_problem = str(exc).splitlines()[0]
            leaked_shm = shm_segments(prefix)
    finally:
        if tmpfs:
            subprocess.run(["umount", str(kv_dir)], capture_output=True)
        shutil.rmtree(kv_dir, ignore_errors=True)
    return report(args, reference, records, injector, sampler, t0, t1, budget, corrupt_events,
                  stop_problem, leaked_shm, tmpfs, time.monotonic() - started)


# After a disk fault ends, writes resume within one backoff delay at most (common/backoff.py).
PAUSE_S = MAX_S


def restore_check(records: list[Record], faults: list[Fault]):
    """Each agent's first turn after each fault: cached >= prompt - new - one page.

    A short one is excused (counted apart) if its conversation was under way while pages
    could not be written (a disk fault, until PAUSE_S after it ended) or when a page file was
    corrupted: its pages may legitimately be missing."""
    turns = sorted((r for r in records if r.kind == "turn" and r.text is not None),
                   key=lambda r: r.started)
    prev_prompt: dict[tuple[int, int], int] = {}  # (agent, conv) -> prompt of the turn before
    previous_of, conv_start = {}, {}
    for r in turns:
        conv = (r.agent, r.key[0])
        previous_of[id(r)] = prev_prompt.get(conv, 0)
        prev_prompt[conv] = r.prompt
        conv_start.setdefault(conv, r.started)
    lossy = [(f.started, f.ended + PAUSE_S) if f.kind in ("disk_full", "readonly")
             else (f.started, f.started) for f in faults if not f.kind.startswith("kill")]
    judged, excused, failed = 0, 0, []
    for fault in faults:
        seen = set()
        for r in turns:
            if r.started < fault.ended or r.agent in seen:
                continue
            seen.add(r.agent)
            new = r.prompt - previous_of[id(r)]
            judged += 1
            if r.cached >= r.prompt - new - PAGE:
                continue
            start = conv_start[(r.agent, r.key[0])]
            if any(start <= hi and lo <= r.started for lo, hi in lossy):
                excused += 1
            else:
                failed.append((fault.kind, r.agent, r.key, r.prompt, new, r.cached,
                               r.started - fault.ended))
    return judged, excused, failed


def report(args, reference, records, injector, sampler, t0, t1, budget, corrupt_events,
           stop_problem, leaked_shm, tmpfs, wall) -> int:
    turns = [r for r in records if r.kind == "turn"]
    bad_status = [p for r in records for p in r.problems]
    compared = [r for r in turns if (r.agent, r.key) in reference and r.text is not None]
    wrong = [r for r in compared if r.text != reference[(r.agent, r.key)]]
    judged, excused, failed = restore_check(records, injector.faults)
    max_disk = max((b for _, b in sampler.disk), default=0)
    rss_rows = []
    rss_ok = True
    for role, samples in sampler.rss.items():
        g = rss_growth(samples, t0, t1)
        if g is None:  # restarted too late in the run to judge it: said, not failed
            rss_rows.append([f"{role} RSS growth, second half",
                             "not judged: restarted late" if samples else "no samples"])
            rss_ok &= bool(samples)
            continue
        pid, first, last, growth, n = g
        rss_ok &= growth < 0.05
        rss_rows.append([f"{role} RSS growth, second half (pid {pid}, {n} samples)",
                         f"{first} -> {last} KiB = {growth * 100:+.1f}%"])
    fault_counts: dict[str, int] = {}
    for f in injector.faults:
        fault_counts[f.kind] = fault_counts.get(f.kind, 0) + 1
    statuses: dict[str, int] = {}
    for r in records:
        statuses[f"{r.kind} {r.status}"] = statuses.get(f"{r.kind} {r.status}", 0) + 1
    rows = [
        ["run length (s) / total wall (s)", f"{t1 - t0:.0f} / {wall:.0f}"],
        ["page disk", f"tmpfs {args.kv_disk_size}" if tmpfs else "plain dir (no disk-full)"],
        ["faults", ", ".join(f"{k} x{v}" for k, v in sorted(fault_counts.items())) or "none"],
        ["fault injector errors", "; ".join(injector.errors) or "0"],
        ["requests (kind status: count)", ", ".join(f"{k}: {v}"
                                                    for k, v in sorted(statuses.items()))],
        ["retries (503/429 + Retry-After, conn errors, stream errors)",
         sum(r.retries for r in records)],
        ["responses outside 2xx / 4xx-malformed / 503,429+Retry-After", len(bad_status)],
        ["replies compared with the reference", f"{len(compared)} of {len(turns)} turns"],
        ["wrong outputs", len(wrong)],
        ["first turns after a fault: judged / short / short but excused (pages lost)",
         f"{judged} / {len(failed)} / {excused}"],
        ["bad pages met (kv.corrupt_page)", len(corrupt_events)],
        ["page bytes on disk, max sampled / budget", f"{max_disk} / {budget}"],
        *rss_rows,
        ["group stop", stop_problem or "clean (no process, pid file left)"],
        ["leaked /dev/shm segments", ", ".join(leaked_shm) or "0"],
    ]
    print(table(["soak", "value"], rows))
    for (at, nbytes), counted in zip(sampler.disk, sampler.counted):
        if nbytes > budget:
            last = max((f for f in injector.faults if f.started <= at), default=None,
                       key=lambda f: f.started)
            print(f"  over budget at {at - t0:.0f}s: {nbytes} bytes (+{nbytes - budget}); "
                  + (f"last fault {last.kind} at {last.started - t0:.0f}s" if last else
                     "no fault before")
                  + (f"; the scheduler counted {counted.bytes} bytes on disk, "
                     f"{counted.num_writing} pages being written" if counted else
                     "; no status.json then"))
    for p in sorted(set(bad_status))[:10]:
        print("  status problem:", p)
    for r in wrong[:10]:
        print(f"  wrong: agent {r.agent} {r.key}: {r.text!r} != {reference[(r.agent, r.key)]!r}")
    for f in failed[:10]:
        print("  not restored after %s: agent %d %s prompt %d new %d cached %d, sent %.1fs "
              "after the fault" % f)
    ok = (not bad_status and not wrong and not failed and max_disk <= budget and rss_ok
          and not stop_problem and not leaked_shm and not injector.errors)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
