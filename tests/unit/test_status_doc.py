"""The status document (proto/status.py): its one reader never raises, and its JSON keeps the
field names the dashboard's script and `switchyard status --json` users read."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import msgspec
import pytest

from switchyard.proto.status import (
    STATUS_VERSION,
    DiskStatus,
    KvMemoryStatus,
    PeerStatus,
    QueuedRequest,
    RankStatus,
    SlotStatus,
    Status,
    decode_status,
    encode_status,
    read_status,
    write_status,
)
from switchyard.scheduler.stats import SchedulerStats


def document(now: float = 1000.0) -> Status:
    stats = SchedulerStats()
    stats.request_finished(SimpleNamespace(
        finish_reason="stop", num_prompt_tokens=40, num_reused_tokens=32, num_copied_tokens=0,
        num_restored_tokens=0, num_prefilled_tokens=8, num_generated_tokens=3,
        num_cached_tokens=32, ttft_s=0.05, priority="interactive", num_proposed_tokens=6,
        num_accepted_tokens=4, rid="r0", conversation="0123456789ab#2", duration_s=0.25),
        now - 1)
    stats.step_done(0.01)
    return Status(
        version=STATUS_VERSION, at=now, boot_id="s" * 16, pid=os.getpid(), started_at=now - 9,
        worker_ready=True, kvstore_ready=True,
        peers={"worker": PeerStatus(boot_id="w" * 16, pid=7, last_seen=now),
               "gateway": PeerStatus(boot_id="g" * 16, pid=None, last_seen=None)},
        slots=[SlotStatus(slot=0, num_tokens=40, conversation="0123456789ab", last_used=now,
                          rid="r1", priority="interactive", state="decoding", waiting_s=None)],
        queue=[QueuedRequest(rid="r2", priority="background", waiting_s=0.5, prompt_tokens=9)],
        oldest_waiting_s=0.5,
        disk=DiskStatus(bytes=4096, budget_bytes=2**30, num_pages=1, writable=True,
                        num_evicted=0, num_thrash=0, num_writing=0),
        ranks=[RankStatus(rank=0, host="localhost", namespace="00112233", shm_name="shm0",
                          num_buffers=8, buffer_bytes=4096, kvstore="kvstore",
                          kvstore_state="ready", num_pages=1)],
        stats=stats.snapshot(),
        kv_memory=KvMemoryStatus(held_tokens=1280, budget_tokens=100_000, num_tokens=40,
                                 num_running=1, num_resident=1, num_preempted=2,
                                 num_shelved=3, shelved_tokens=900, num_cut=1,
                                 cut_kept_tokens=512),
    )


def test_written_and_read_back_equal(tmp_path):
    path = tmp_path / "status.json"
    write_status(path, document())
    assert read_status(path) == document()
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left


def test_json_field_names_are_the_documented_ones():
    """What gateway/static/dashboard.js and scripts reading `status --json` rely on."""
    raw = json.loads(encode_status(document()))
    assert list(raw) == ["version", "at", "boot_id", "pid", "started_at", "worker_ready",
                         "kvstore_ready", "peers", "slots", "queue", "oldest_waiting_s",
                         "disk", "ranks", "stats", "speculation", "prefill_share",
                         "kv_memory", "peer_servers"]
    assert raw["kv_memory"] == {"held_tokens": 1280, "budget_tokens": 100_000,
                                "num_tokens": 40, "num_running": 1, "num_resident": 1,
                                "num_preempted": 2, "num_shelved": 3, "shelved_tokens": 900,
                                "num_cut": 1, "cut_kept_tokens": 512}
    assert set(raw["slots"][0]) == {"slot", "num_tokens", "conversation", "last_used", "rid",
                                    "priority", "state", "waiting_s", "tenant"}
    assert set(raw["disk"]) == {"bytes", "budget_bytes", "num_pages", "writable",
                                "num_evicted", "num_thrash", "num_writing", "error",
                                "num_unwritten"}
    stats = raw["stats"]
    assert set(stats) == {"requests_finished", "requests_failed", "tokens", "ttft",
                          "step_time", "num_steps", "restarts", "recent_requests",
                          "by_tenant"}
    assert stats["tokens"] == {"prompt": 40, "reused": 32, "copied": 0, "restored": 0,
                               "prefilled": 8, "generated": 3, "draft_proposed": 6,
                               "draft_accepted": 4}
    assert set(stats["ttft"]) == {"bounds", "counts", "sum", "count"}
    assert stats["recent_requests"] == [{"at": 999.0, "ttft_s": 0.05, "cause": "reused",
                                         "prompt_tokens": 40, "cached_tokens": 32,
                                         "priority": "interactive", "tenant": "",
                                         "rid": "r0", "conversation": "0123456789ab#2",
                                         "started_at": 998.75, "reused_tokens": 32,
                                         "copied_tokens": 0, "restored_tokens": 0,
                                         "prefilled_tokens": 8, "generated_tokens": 3}]
    assert raw["peers"]["gateway"] == {"boot_id": "g" * 16, "pid": None, "last_seen": None}


def test_a_missing_file_or_a_directory_is_no_status(tmp_path):
    assert read_status(tmp_path / "status.json") is None
    (tmp_path / "status.json").mkdir()
    assert read_status(tmp_path / "status.json") is None


@pytest.mark.parametrize("data", [
    b"", b"{", b"not json", b"[]", b"null", b'{"version": 1}',
    encode_status(document())[:-1],  # cut short
    encode_status(document())[:200],
])
def test_anything_but_a_whole_document_is_no_status(tmp_path, data):
    path = tmp_path / "status.json"
    path.write_bytes(data)
    assert read_status(path) is None


def test_another_version_or_shape_is_no_status():
    newer = msgspec.structs.replace(document(), version=STATUS_VERSION + 1)
    assert decode_status(encode_status(newer)) is None
    raw = json.loads(encode_status(document()))
    raw["slots"][0]["state"] = "swapping"  # a state this version does not know
    assert decode_status(json.dumps(raw)) is None
    del raw["slots"][0]["state"]
    assert decode_status(json.dumps(raw)) is None


def test_fields_a_newer_writer_adds_are_ignored():
    raw = json.loads(encode_status(document()))
    raw["later"] = {"x": 1}
    raw["disk"]["later"] = 2
    assert decode_status(json.dumps(raw)) == document()
