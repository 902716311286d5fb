"""Observability of a real group: /metrics after a known workload, `switchyard status` against
it, and logs that never carry prompt text.

The group has 2 slots and 16-token pages, so three conversations do not all fit in memory and a
returning one is restored from disk, while the latest one's next turn reuses its slot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.common.settings import parse_size
from switchyard.proto.status import read_status
from switchyard.testing.group import ServerGroup, short_tmp_dir
from tests.helpers.checkout import REPO_ROOT

EXTRA = ("--page-size", "16", "--prefill-chunk", "256")
CHAT = (("endpoint", "/v1/chat/completions"), ("method", "POST"), ("status", "200"))


@pytest.fixture(scope="module")
def ops_group(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=2, ctx=2048, extra=EXTRA) as running:
        yield running


def scrape(group: ServerGroup) -> dict[tuple, float]:
    response = httpx.get(f"{group.url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, timeout_s: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def finished(samples: dict) -> float:
    return sum(v for (name, _), v in samples.items()
               if name == "switchyard_requests_finished_total")


def scrape_after(group: ServerGroup, num_finished: float) -> dict:
    """A scrape once the scheduler's snapshot counts `num_finished` finished requests."""
    return wait_for(lambda: (lambda s: s if finished(s) >= num_finished else None)(scrape(group)),
                    what=f"{num_finished} finished requests in status.json")


def conversation(i: int) -> list[dict]:
    return [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": f"Conversation {i}: " + "tell me about trains " * 12}]


def turn(client: openai.OpenAI, model: str, messages: list[dict]):
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                           temperature=0)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    return reply.usage


def test_metrics_follow_a_known_workload(ops_group):
    group = ops_group
    client = openai.OpenAI(base_url=group.base_url, api_key="none")
    model = client.models.list().data[0].id
    before = scrape(group)
    assert value(before, "switchyard_status_up") == 1
    assert value(before, "switchyard_slots") == 2
    assert value(before, "switchyard_kv_disk_budget_bytes") == parse_size("32GiB")

    convs = [conversation(i) for i in range(3)]
    usages = [turn(client, model, messages) for messages in convs]
    after = scrape_after(group, finished(before) + 3)
    assert value(after, "switchyard_http_requests_total", **dict(CHAT)) == (
        value(before, "switchyard_http_requests_total", **dict(CHAT)) + 3)
    assert value(after, "switchyard_tokens_total", kind="prompt") - value(
        before, "switchyard_tokens_total", kind="prompt") == sum(u.prompt_tokens for u in usages)
    assert value(after, "switchyard_tokens_total", kind="generated") - value(
        before, "switchyard_tokens_total", kind="generated") == sum(
        u.completion_tokens for u in usages)
    assert value(after, "switchyard_tokens_total", kind="prefilled") > value(
        before, "switchyard_tokens_total", kind="prefilled")
    assert value(after, "switchyard_ttft_seconds_count") == value(
        before, "switchyard_ttft_seconds_count") + 3
    assert value(after, "switchyard_steps_total") > value(before, "switchyard_steps_total")
    assert value(after, "switchyard_step_seconds_count") == value(after, "switchyard_steps_total")
    assert value(after, "switchyard_slots_by_state", state="idle") == 2
    assert value(after, "switchyard_queue_depth", priority="interactive") == 0
    # The pages of all three conversations reach the disk.
    wait_for(lambda: (lambda s: value(s, "switchyard_kv_disk_pages") > 0
                      and value(s, "switchyard_kv_pages_writing") == 0)(scrape(group)),
             what="pages written")
    assert value(scrape(group), "switchyard_kv_disk_bytes") > 0

    # The latest conversation is still in its slot: its next turn reuses it.
    usage = turn(client, model, convs[2])
    reused = scrape_after(group, finished(before) + 4)
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert value(reused, "switchyard_tokens_total", kind="reused") > value(
        after, "switchyard_tokens_total", kind="reused")
    # The first one lost its slot to the third: its next turn comes back from disk.
    usage = turn(client, model, convs[0])
    restored = scrape_after(group, finished(before) + 5)
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert value(restored, "switchyard_tokens_total", kind="restored") > value(
        reused, "switchyard_tokens_total", kind="restored")

    httpx.get(f"{group.url}/no/such/route/{uuid.uuid4().hex}")
    final = scrape(group)
    assert value(final, "switchyard_http_requests_total", endpoint="other", method="GET",
                 status="404") >= 1
    for role in ("gateway", "worker", "kvstore"):
        assert value(final, "switchyard_component_restarts_total", component=role) == 0


def run_status(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "switchyard.deploy.cli", "status", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def test_status_command_against_the_group(ops_group):
    group = ops_group
    client = openai.OpenAI(base_url=group.base_url, api_key="none")
    model = client.models.list().data[0].id
    turn(client, model, conversation(7))
    pids = group.wait_components()
    status_file = group.runtime_dir / "status.json"
    wait_for(lambda: (status := read_status(status_file)) and any(
        s.conversation for s in status.slots), what="a resident conversation in status.json")

    done = run_status("--json", "--runtime-dir", str(group.runtime_dir))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["running"]
    assert report["components"]["supervisor"]["pid"] == group.supervisor_pid
    for role, pid in pids.items():
        component = report["components"][role]
        assert component["pid"] == pid and component["alive"]
        assert 0 < component["uptime_s"] < 600
    snapshot = report["snapshot"]
    assert snapshot["peers"]["worker"]["pid"] == pids["worker"]
    conversations = [s["conversation"] for s in snapshot["slots"] if s["conversation"]]
    assert conversations

    done = run_status("--runtime-dir", str(group.runtime_dir))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    for role, pid in pids.items():
        line = next(line for line in text.splitlines() if line.strip().startswith(role + " "))
        assert str(pid) in line and "running" in line
    assert all(c in text for c in conversations)
    assert "slots (2)" in text and "queue: empty" in text and "32.0 GiB budget" in text


def test_logs_never_carry_prompt_text(tiny_qwen3):
    """The gateway never logs content, even with --log-content (nothing checks
    common.logs.content_allowed() yet), so only the default is tested: a marker sent every way a
    request can carry text appears in no log line, no status snapshot and no metric."""
    marker = f"MARKER-{uuid.uuid4().hex}"
    runtime_dir = short_tmp_dir("syl")
    try:
        with ServerGroup(tiny_qwen3, slots=2, ctx=2048, extra=EXTRA,
                         runtime_dir=runtime_dir) as group:
            client = openai.OpenAI(base_url=group.base_url, api_key="none")
            model = client.models.list().data[0].id
            messages = [{"role": "system", "content": f"System says {marker}."},
                        {"role": "user", "content": f"Please repeat {marker} twice."}]
            client.chat.completions.create(model=model, messages=messages, max_tokens=4)
            for _ in client.chat.completions.create(model=model, messages=messages,
                                                    max_tokens=4, stream=True,
                                                    stop=[marker]):
                pass
            client.completions.create(model=model, prompt=f"Complete {marker}", max_tokens=4)
            client.chat.completions.create(model=model, messages=messages, max_tokens=4, tools=[{
                "type": "function", "function": {
                    "name": "lookup", "description": f"Looks up {marker}",
                    "parameters": {"type": "object", "properties": {}}}}])
            for bad in ({"model": model, "messages": messages, "temperature": marker},
                        {"model": marker, "messages": messages},
                        {"model": model, "messages": [{"role": marker, "content": marker}]}):
                response = httpx.post(f"{group.base_url}/chat/completions", json=bad, timeout=30)
                assert response.status_code in (400, 404, 422), response.text
            wait_for(lambda: (status := read_status(group.runtime_dir / "status.json"))
                     and status.stats.requests_finished, what="a status snapshot")
            assert marker not in (group.runtime_dir / "status.json").read_text()
            assert marker not in httpx.get(f"{group.url}/metrics").text
            assert marker not in httpx.get(f"{group.base_url}/switchyard/status").text
            assert group.log_events("request.finished")
            pages = [p for p in group.kv_dir.rglob("*") if p.is_file()]
            assert pages and not any(marker.encode() in p.read_bytes() for p in pages)
        log = group.log_path.read_text(errors="replace")  # complete: the group has stopped
        assert "request.finished" in log and '"role": "scheduler"' in log
        assert marker not in log

        # With the group gone, `switchyard status` says so.
        done = run_status("--runtime-dir", str(runtime_dir))
        assert done.returncode == 1 and "no Switchyard group is running" in done.stdout
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
