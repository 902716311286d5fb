"""Scheduling through the whole group: disconnects, queue limits, priorities."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

from switchyard.proto.status import read_status
from switchyard.testing.group import ServerGroup


@pytest.fixture(scope="module")
def one_slot(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=8192, extra=["--max-queue", "1"]) as group:
        yield group


def completion(group, prompt: str, max_tokens: int, priority: str = "interactive",
               timeout: float = 120):
    return httpx.post(f"{group.base_url}/completions", timeout=timeout,
                      headers={"X-Switchyard-Priority": priority},
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def slot_priorities(group) -> list:
    status = read_status(group.runtime_dir / "status.json")
    return [s.priority for s in status.slots] if status else []


def test_client_disconnect_frees_the_slot(one_slot):
    body = {"prompt": "tell me everything " * 20, "max_tokens": 2000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{one_slot.base_url}/completions", json=body,
                      timeout=60) as resp:
        chunks = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks += 1
            if chunks == 5:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        finished = [e for e in one_slot.log_events("request.finished")
                    if e.get("role") == "scheduler" and e["finish_reason"] == "cancelled"]
        if finished:
            break
        time.sleep(0.05)
    assert finished, "the scheduler cancelled the request"
    assert finished[0]["num_generated_tokens"] < 2000
    # The slot is free for the next request at once.
    assert completion(one_slot, "next", 4).status_code == 200


def test_queue_limit_answers_429_with_retry_after(one_slot):
    prompts = [f"request {i} " * 30 for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: completion(one_slot, p, 120), prompts))
    statuses = sorted(r.status_code for r in results)
    assert 200 in statuses and 429 in statuses, statuses
    limited = next(r for r in results if r.status_code == 429)
    assert float(limited.headers["retry-after"]) > 0
    assert limited.json()["error"]["code"] == "queue_full"


def test_interactive_request_takes_a_background_slot(one_slot):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # Long enough to still run when the status file (rewritten every second) shows it.
        background = pool.submit(completion, one_slot, "a long background job " * 10, 1500,
                                 "background")
        deadline = time.monotonic() + 30
        while "background" not in slot_priorities(one_slot) and time.monotonic() < deadline:
            time.sleep(0.05)
        interactive = completion(one_slot, "a quick question", 8)
        assert interactive.status_code == 200
        bg = background.result()
    assert bg.status_code == 200
    assert bg.json()["usage"]["completion_tokens"] == 1500, "resumed and finished its reply"
    assert one_slot.log_events("request.preempted")
    # The background request was finished after the interactive one (its line may reach
    # the log just after its reply).
    one_slot.wait_events("request.finished", role="scheduler", num_generated_tokens=1500)
    order = [e["priority"] for e in one_slot.log_events("request.finished")
             if e.get("role") == "scheduler" and e["num_generated_tokens"] in (8, 1500)]
    assert order[-2:] == ["interactive", "background"]


@pytest.fixture(scope="module")
def running_past_slots(tiny_qwen3):
    with ServerGroup(tiny_qwen3, slots=1, ctx=8192,
                     extra=["--max-running", "0", "--release-after-s", "1"]) as group:
        yield group


def test_requests_past_the_resident_slots_run_at_once_then_leave_memory(running_past_slots):
    """--slots 1 and --max-running 0, the default: the worker runs as many as its KV budget
    holds at 8K tokens each, up to 32 (all 32 for the tiny model). Three agents under one
    system prompt
    run at once (none waits for another's reply; the later ones wait only for the first one's
    prefill of their shared prefix, and copy it), then, idle past --release-after-s,
    only one conversation stays in memory; the others' next turns restore theirs from disk."""
    import openai

    group = running_past_slots
    plan = group.wait_events("worker.memory_plan", 1)
    assert plan and plan[0]["running"] == 32
    system = "You are a careful coding agent. Follow the rules. " * 30
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Task {i}: list the files under src/{i}."}]
             for i in range(3)]
    with openai.OpenAI(base_url=group.base_url, api_key="none", timeout=120) as client:
        model = client.models.list().data[0].id

        def ask(messages):
            return client.chat.completions.create(model=model, messages=messages,
                                                  max_tokens=48, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = list(pool.map(ask, chats))
        done = group.wait_events("request.finished", 3, role="scheduler")
        assert len(done) == 3
        # Each is placed as it arrives or once the shared prefix is in a slot to copy: one
        # at a time, the last would queue for the other two's whole replies.
        assert max(e["queue_s"] for e in done) < min(e["duration_s"] for e in done), done
        assert sum(e["num_copied_tokens"] > 0 for e in done) == 2, done
        replied_at = time.time()
        deadline = time.monotonic() + 30
        while True:
            status = read_status(group.runtime_dir / "status.json")
            # Only a status written after the replies says what they left (it is rewritten
            # every second: one from before them shows every slot empty).
            held = [s for s in status.slots if s.num_tokens] \
                if status and status.at > replied_at else None
            if held is not None and len(held) <= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert held is not None and len(status.slots) == 32, "no status written after the replies"
        assert len(held) == 1, ("idle, one conversation stays in memory (--slots 1)",
                                [(e.get("role"), e["event"]) for e in group.log_events()
                                 if e["event"] in ("worker.lost", "kvstore.lost",
                                                   "component.restarted", "step.failed")],
                                status.slots)

        follow = [chat + [{"role": "assistant", "content": r.choices[0].message.content},
                          {"role": "user", "content": "Next step."}]
                  for chat, r in zip(chats, first)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            second = list(pool.map(ask, follow))
    for reply, before in zip(second, first):
        # At least the whole first prompt is cached (the system prompt alone could be copied
        # from the slot kept in memory): the released ones restored theirs from disk.
        assert reply.usage.prompt_tokens_details.cached_tokens >= before.usage.prompt_tokens


# The tiny model's KV: 4 layers x 2 heads x 64 x (K, V) x float32 = 4096 bytes a token.
TINY_KV_BYTES_PER_TOKEN = 4096
KV_BUDGET_TOKENS = 6000


@pytest.fixture(scope="module")
def small_kv_memory(tiny_qwen3):
    """Four requests run at once in a KV budget of 6000 tokens, which holds about two of them
    at 1K tokens (what a request's caches may take: docs/design/kv-pages.md "Memory plan")."""
    with ServerGroup(tiny_qwen3, slots=1, ctx=2048,
                     extra=["--max-running", "4", "--release-after-s", "1", "--kv-memory",
                            str(KV_BUDGET_TOKENS * TINY_KV_BYTES_PER_TOKEN)]) as group:
        yield group


def test_requests_that_outgrow_memory_are_staged_to_disk_and_none_fails_or_rereads(
        small_kv_memory):
    """Four requests start together at ~200 tokens and grow towards 1.1K: before their KV
    outgrows the budget the newest are staged to disk (their pages are there already) and
    resume by restoring them. Every reply is whole, and no request prefills again a token it
    had."""
    group = small_kv_memory
    [plan] = group.wait_events("worker.memory_plan", 1)
    assert plan["kv_budget_tokens"] == KV_BUDGET_TOKENS and plan["running"] == 4
    assert plan["kv_bytes_per_token"] == TINY_KV_BYTES_PER_TOKEN
    prompts = [f"agent {i} reads the file src/module_{i}.py and " * 10 for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: completion(group, p, 900, timeout=600), prompts))
    assert [r.status_code for r in replies] == [200] * 4, [r.text[:200] for r in replies]
    # Whole replies: the random model ends some early (greedy, the same every run).
    assert {r.json()["choices"][0]["finish_reason"] for r in replies} <= {"length", "stop"}
    done = group.wait_events("request.finished", 4, role="scheduler")
    staged = [e for e in group.log_events("request.preempted") if e["reason"] == "memory"]
    assert staged, "memory ran short: the test must fill it"
    assert all(e["held_tokens"] > KV_BUDGET_TOKENS for e in staged)
    resumed = group.log_events("request.resumed")
    assert len(resumed) == len(staged)
    assert all(e["num_reread"] == 0 for e in resumed), resumed
    assert [e["num_reread_tokens"] for e in done] == [0] * 4
    # The status document shows the budget and what was staged for it.
    deadline = time.monotonic() + 10
    while True:
        status = read_status(group.runtime_dir / "status.json")
        kv = status.kv_memory if status else None
        if kv is not None and kv.num_preempted == len(staged) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kv is not None and kv.budget_tokens == KV_BUDGET_TOKENS
    assert kv.num_preempted == len(staged)


@pytest.fixture(scope="module")
def siblings_in_tight_memory(tiny_qwen3):
    """Four resident slots in a KV budget of 6000 tokens: three idle sub-agents of ~1.3K tokens
    each hold more than half of it as copies."""
    with ServerGroup(tiny_qwen3, slots=4, ctx=2048,
                     extra=["--kv-memory", str(KV_BUDGET_TOKENS * TINY_KV_BYTES_PER_TOKEN)]) as group:
        yield group


def test_idle_sub_agents_hold_their_shared_prompt_once(siblings_in_tight_memory):
    """Three sub-agents under one long system prompt, idle between turns, are shelved as shared
    pages (docs/design/kv-pages.md "Shared pages in memory"): the status shows them holding
    the prompt once. Their next turns read only their new tokens and give the same replies as
    when sent again."""
    group = siblings_in_tight_memory
    system = "You are a careful coding agent. Follow the rules and read the files. " * 50
    prompts = [f"{system}\nTask {i}: list the files under src/{i} and say what each does."
               for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = list(pool.map(lambda p: completion(group, p, 16), prompts))
    assert [r.status_code for r in first] == [200] * 3, [r.text[:200] for r in first]
    group.wait_events("request.finished", 3, role="scheduler")
    deadline = time.monotonic() + 30
    while True:
        status = read_status(group.runtime_dir / "status.json")
        kv = status.kv_memory if status else None
        if kv is not None and kv.num_shelved >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Two idle beside one running hold over half the budget: they are shelved. The last one
    # is too if it went idle in the same step; if later, what stays is below half and it
    # stays whole (making it whole again would cost a copy).
    assert kv is not None and kv.num_shelved >= 2, kv
    longest = max(r.json()["usage"]["prompt_tokens"] for r in first)
    assert longest > 1200  # three copies: over half the budget
    # The prompt once, and each one's own few dozen tokens.
    assert kv.shelved_tokens < longest + 100 * kv.num_shelved, kv

    follow = [p + r.json()["choices"][0]["text"] + "\nNext step." for p, r in zip(prompts, first)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        second = list(pool.map(lambda p: completion(group, p, 16), follow))
    again = [completion(group, p, 16) for p in follow]
    done = group.wait_events("request.finished", 9, role="scheduler")[3:6]
    for reply, before in zip(second, first):  # (the prompt's last token may merge with the text)
        assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] \
            >= before.json()["usage"]["prompt_tokens"] - 1
    # Each reads only its own new tokens (a few dozen), whichever slot it lands in.
    assert all(e["num_prefilled_tokens"] <= 30 and e["num_reread_tokens"] == 0 for e in done), done
    assert [r.json()["choices"][0]["text"] for r in second] == \
        [r.json()["choices"][0]["text"] for r in again]


@pytest.fixture(scope="module")
def two_slots_in_tight_memory(tiny_qwen3):
    """Two slots in a KV budget of 3000 tokens: an idle conversation of ~1.7K tokens and a
    newcomer of ~0.9K do not both fit whole."""
    with ServerGroup(tiny_qwen3, slots=2, ctx=2048,
                     extra=["--kv-memory", str(3000 * TINY_KV_BYTES_PER_TOKEN)]) as group:
        yield group


def test_a_conversation_cut_for_a_newcomer_restores_only_its_end(two_slots_in_tight_memory):
    """A newcomer that needs part of an idle conversation's room cuts it (docs/design/kv-pages.md
    "Cut slots"): the conversation keeps its leading pages in memory, and its next turn
    restores only the rest from disk, re-reads nothing, and replies as when sent again."""
    group = two_slots_in_tight_memory
    first = " ".join(f"file{i}.py holds class Model{i} and its tests" for i in range(88))
    a = completion(group, first, 4)
    assert a.status_code == 200, a.text[:200]
    held = a.json()["usage"]["prompt_tokens"]
    assert 1600 < held < 1900, held  # six whole pages of 256 and a tail
    newcomer = " ".join(f"note {i}: the build passed on runner {i * 7}" for i in range(45))
    b = completion(group, newcomer, 4)
    assert b.status_code == 200, b.text[:200]
    assert 700 < b.json()["usage"]["prompt_tokens"] < 1100
    deadline = time.monotonic() + 10
    while True:  # the status shows the cut, and what it kept
        status = read_status(group.runtime_dir / "status.json")
        kv = status.kv_memory if status else None
        if kv is not None and kv.num_cut or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kv is not None and kv.num_cut == 1 and 1000 < kv.cut_kept_tokens < held, kv

    follow = first + a.json()["choices"][0]["text"] + " Next step."
    second = completion(group, follow, 8)
    again = completion(group, follow, 8)
    done = group.wait_events("request.finished", 4, role="scheduler")
    turn = done[2]
    # Kept: six pages; restored: the rest of the conversation (a whole release restores all).
    assert turn["num_reread_tokens"] == 0 and 0 < turn["num_restored_tokens"] < held - 1000, turn
    assert turn["num_prefilled_tokens"] <= 20, turn
    assert second.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]
