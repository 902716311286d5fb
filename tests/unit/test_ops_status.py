"""`switchyard status`: pid files and uptimes of a runtime directory, status.json formatting."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import msgspec
import pytest

from switchyard.deploy import cli
from switchyard.deploy import status as status_cli
from switchyard.proto.status import (
    SpeculationStatus,
    STATUS_VERSION,
    DiskStatus,
    PeerStatus,
    QueuedRequest,
    RankStatus,
    SlotStatus,
    Status,
    write_status,
)
from switchyard.scheduler.stats import SchedulerStats


def record(**kw):
    fields = dict(finish_reason="stop", num_prompt_tokens=100, num_reused_tokens=0,
                  num_copied_tokens=0, num_restored_tokens=0, num_prefilled_tokens=100,
                  num_generated_tokens=5, num_cached_tokens=0, ttft_s=0.2, priority="interactive",
                  num_proposed_tokens=0, num_accepted_tokens=0)
    return SimpleNamespace(**(fields | kw))


def snapshot(now: float) -> Status:
    stats = SchedulerStats()
    stats.request_finished(record(), now - 5)
    stats.request_finished(record(num_reused_tokens=90, num_prefilled_tokens=10,
                                  num_cached_tokens=90, ttft_s=0.02, num_proposed_tokens=40,
                                  num_accepted_tokens=30), now - 2)
    stats.request_failed("queue_full")
    stats.step_done(0.01)
    return Status(
        version=STATUS_VERSION, at=now - 0.5, boot_id="b" * 16, pid=os.getpid(),
        started_at=now - 60, worker_ready=True, kvstore_ready=True,
        peers={"worker": PeerStatus(boot_id="w" * 16, pid=11, last_seen=now)},
        slots=[
            SlotStatus(slot=0, num_tokens=12345, conversation="abcdef012345",
                       last_used=now - 75, rid="chatcmpl-1", priority="interactive",
                       state="decoding", waiting_s=None),
            SlotStatus(slot=1, num_tokens=0, conversation=None, last_used=None, rid=None,
                       priority=None, state="idle", waiting_s=None)],
        queue=[QueuedRequest(rid="chatcmpl-2", priority="background", waiting_s=3.25,
                             prompt_tokens=999)],
        oldest_waiting_s=3.25,
        disk=DiskStatus(bytes=3 * 2**30, budget_bytes=32 * 2**30, num_pages=1200,
                        writable=True, num_evicted=7, num_thrash=1, num_writing=2),
        ranks=[],
        stats=stats.snapshot(),
        speculation=SpeculationStatus(mode="batched", max_draft_tokens=8),
    )


def test_format_duration():
    assert status_cli.format_duration(None) == "-"
    assert status_cli.format_duration(5.9) == "5s"
    assert status_cli.format_duration(75) == "1m15s"
    assert status_cli.format_duration(3 * 3600 + 120) == "3h02m"
    assert status_cli.format_duration(2 * 86400 + 3600) == "2d01h"


def test_parse_etime():
    assert status_cli.parse_etime("42") == 42
    assert status_cli.parse_etime("01:05") == 65
    assert status_cli.parse_etime("02:00:01") == 7201
    assert status_cli.parse_etime("3-00:00:10") == 3 * 86400 + 10
    assert status_cli.parse_etime("") is None and status_cli.parse_etime("x:1") is None


def test_report_text():
    now = time.time()
    report = {"runtime_dir": "/run/sy", "at": now, "running": True,
              "components": {"supervisor": {"pid": 10, "alive": True, "uptime_s": 61},
                             "scheduler": {"pid": os.getpid(), "alive": True, "uptime_s": 60},
                             "worker": {"pid": 11, "alive": False, "uptime_s": None},
                             "gateway": {"pid": None, "alive": False, "uptime_s": None}},
              "snapshot": snapshot(now), "snapshot_age_s": 0.5}
    text = status_cli.format_report(report)
    assert "Switchyard group in /run/sy" in text
    assert "not running (stale pid file)" in text and "no pid file" in text
    assert "bbbbbbbbbbbbbbbb" in text and "wwwwwwwwwwwwwwww" in text  # boot ids
    slot_line = next(line for line in text.splitlines() if "abcdef012345" in line)
    assert "decoding" in slot_line and "12,345" in slot_line and "1m15s ago" in slot_line
    assert "interactive" in slot_line
    assert "queue: 1 waiting" in text and "chatcmpl-2" in text and "background" in text
    assert "3.0 GiB of 32.0 GiB budget (9.4%)" in text and "7 evicted" in text
    assert "1 thrash events" in text
    assert "2 finished (stop 2), 1 failed (queue_full 1)" in text
    assert "reused 90" in text and "prefilled 110" in text
    assert "speculative decoding: every decoding sequence, up to 8 draft tokens copied from " \
           "the conversations; 40 proposed, 30 accepted (75%)" in text
    report["snapshot_age_s"] = 60
    assert "STALE" in status_cli.format_report(report)


def test_report_lists_every_rank_of_a_worker_group():
    now = time.time()
    snap = msgspec.structs.replace(snapshot(now), ranks=[
        RankStatus(rank=0, host="mac-a", namespace="00112233", shm_name="syr0w",
                   num_buffers=64, buffer_bytes=2**20, kvstore="kvstore",
                   kvstore_state="ready", num_pages=1200),
        RankStatus(rank=1, host="mac-b", namespace="44556677", shm_name="syr1w",
                   num_buffers=64, buffer_bytes=2**20, kvstore="kvstore.1",
                   kvstore_state="silent", num_pages=1199)])
    report = {"runtime_dir": "/run/sy", "at": now, "running": True, "components": {},
              "snapshot": snap, "snapshot_age_s": 0.5}
    lines = status_cli.format_report(report).splitlines()
    assert "worker group: 2 ranks" in lines
    rank1 = next(line for line in lines if "mac-b" in line)
    assert rank1.split() == ["1", "mac-b", "64", "x", "1.0", "MiB", "kvstore.1", "silent",
                             "1,199"]
    single = status_cli.format_report(report | {"snapshot": snapshot(now)})
    assert "worker group" not in single


def test_collect_reads_pid_files_and_uptimes(tmp_path):
    (tmp_path / "scheduler.pid").write_text(f"{os.getpid()}\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "worker.pid").write_text(f"{dead.pid}\n")
    now = time.time()
    write_status(tmp_path / "status.json", snapshot(now))
    report = status_cli.collect(tmp_path, now)
    assert report["running"]
    me = report["components"]["scheduler"]
    assert me["alive"] and me["pid"] == os.getpid()
    assert 0 < me["uptime_s"] < time.monotonic() + 60  # this test process's age
    assert report["components"]["worker"] == {"pid": dead.pid, "alive": False, "uptime_s": None}
    assert report["components"]["gateway"]["pid"] is None
    assert abs(report["snapshot_age_s"] - 0.5) < 1e-6
    assert report["snapshot"] == snapshot(now)  # the file round-trips the typed document
    assert "worker.1" not in report["components"]
    for name in ("kvstore.10", "worker.1", "kvstore.1", "worker.x", "other.1"):
        (tmp_path / f"{name}.pid").write_text(f"{os.getpid()}\n")
    ranks = [r for r in status_cli.collect(tmp_path, now)["components"] if "." in r]
    assert ranks == ["kvstore.1", "worker.1", "kvstore.10"]  # a group's other local ranks


@pytest.mark.parametrize("platform", ["this", "ps"])
def test_uptime_of_a_young_process(monkeypatch, platform):
    if platform == "ps":  # the path for systems without /proc (macOS): `ps -o etimes=`
        if shutil.which("ps") is None:
            pytest.skip("no ps here")
        monkeypatch.setattr(sys, "platform", "darwin")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(1.2)
        age = status_cli.uptime_s(child.pid)
        assert age is not None and 0.5 <= age < 10
    finally:
        child.kill()
        child.wait()


def test_status_command(tmp_path, capsys):
    assert cli.main(["status", "--runtime-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"no Switchyard group is running in {tmp_path}" in out
    (tmp_path / "gateway.pid").write_text(f"{os.getpid()}\n")
    write_status(tmp_path / "status.json", snapshot(time.time()))
    assert cli.main(["status", "--json", "--runtime-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["running"] and report["components"]["gateway"]["pid"] == os.getpid()
    assert report["snapshot"]["slots"][0]["conversation"] == "abcdef012345"


def test_the_speculation_line_says_whose_drafts():
    from switchyard.proto.status import TokenCounts

    tokens = TokenCounts(draft_proposed=10, draft_accepted=9)
    line = status_cli.format_speculation(
        SpeculationStatus(mode="batched", max_draft_tokens=4, proposers="suffix,draft"), tokens)
    assert line == ("speculative decoding: every decoding sequence, up to 4 draft tokens "
                    "copied, else from the draft model; 10 proposed, 9 accepted (90%)")
    line = status_cli.format_speculation(
        SpeculationStatus(mode="alone", max_draft_tokens=4, proposers="draft"), tokens)
    assert "a lone decoding sequence" in line and "from the draft model;" in line


def test_the_prefill_share_line_says_who_yielded():
    from switchyard.proto.status import PrefillShareStatus

    line = status_cli.format_prefill_share(PrefillShareStatus(
        decode_share=0.231, num_protected=3, num_waiting=10, age_s=2.4))
    assert line == ("prefill share: 3 decoding stream(s) kept 0.23 of their solo speed "
                    "beside 10 waiting for a first token (2s ago)")


def test_the_kv_memory_line_shows_what_is_held_against_the_budget():
    from switchyard.proto.status import KvMemoryStatus

    assert status_cli.format_kv_memory(snapshot(time.time())) == []  # not counted
    held = msgspec.structs.replace(snapshot(time.time()), kv_memory=KvMemoryStatus(
        held_tokens=9000, budget_tokens=12000, num_tokens=7000, num_running=3,
        num_resident=4, num_preempted=2))
    assert status_cli.format_kv_memory(held) == [
        "kv memory: 9,000 of 12,000 tokens held (75.0%) (with growth reserves; 7,000 tokens "
        "in 4 slots, 3 running), 2 staged to disk for memory"]
    shelved = msgspec.structs.replace(held, kv_memory=msgspec.structs.replace(
        held.kv_memory, num_shelved=2, shelved_tokens=2500))
    assert status_cli.format_kv_memory(shelved) == [
        "kv memory: 9,000 of 12,000 tokens held (75.0%) (with growth reserves; 7,000 tokens "
        "in 4 slots, 3 running, 2 shelved as 2,500 tokens of shared pages), 2 staged to disk "
        "for memory"]
    cut = msgspec.structs.replace(held, kv_memory=msgspec.structs.replace(
        held.kv_memory, num_cut=3, cut_kept_tokens=4608))
    assert status_cli.format_kv_memory(cut)[0].endswith(
        "2 staged to disk for memory, 3 cut for memory keeping 4,608 tokens")


def test_a_disk_that_refuses_pages_says_why_and_how_many():
    """A full kv-dir shows in `switchyard status`."""
    full = msgspec.structs.replace(snapshot(time.time()), disk=DiskStatus(
        bytes=2**20, budget_bytes=2**30, num_pages=4, writable=False, num_evicted=0,
        num_thrash=0, num_writing=0, num_unwritten=12,
        error="KV page store /kv is unavailable (No space left on device); ..."))
    lines = status_cli.format_disk(full)
    assert lines[0].endswith(", writes paused")
    assert "No space left on device" in lines[1]
    assert "12 pages not written" in lines[2]
    # Writable: one line, as before.
    assert len(status_cli.format_disk(snapshot(time.time()))) == 1
