"""The first turn after a restart re-reads only its new tokens.

Three conversations on `--slots 1`. After a whole-group SIGTERM and start, and after each
single component is killed (the supervisor restarts it), every conversation's next turn is
sent at once: the moment the HTTP port answers, retried at once on a refused connection or a
503, as an agent whose server just restarted does. Each must restore its history and prefill
only its new tokens (cached >= prompt - new - one page): a request that arrives while the
group starts waits for the worker and the page index instead of being placed without them.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time

import httpx

from switchyard.testing.group import ServerGroup, short_tmp_dir
from switchyard.testing.workload import text, wait_ready

PAGE = 256


class Conversation:
    def __init__(self, index: int):
        self.index = index
        self.messages = [{"role": "system", "content": text(1000 + index, 200)},
                         {"role": "user", "content": text(2000 + index, 150)}]
        self.last_prompt = 0
        self.turn = 0

    def send(self, url: str, deadline_s: float = 120.0) -> dict:
        """Send the next turn, retrying at once while the server is not there or not ready;
        returns {prompt, cached, new} and appends the turn to the history."""
        body = {"messages": self.messages, "max_tokens": 4, "temperature": 0}
        deadline = time.monotonic() + deadline_s
        with httpx.Client(timeout=120) as http:
            while True:
                try:
                    resp = http.post(f"{url}/v1/chat/completions", json=body)
                    if resp.status_code == 200:
                        break
                    assert resp.status_code == 503 and resp.headers.get("retry-after"), \
                        resp.text
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "no answer"
                time.sleep(0.02)
        usage = resp.json()["usage"]
        prompt = usage["prompt_tokens"]
        out = {"prompt": prompt, "cached": usage["prompt_tokens_details"]["cached_tokens"],
               "new": prompt - self.last_prompt}
        self.last_prompt = prompt
        self.turn += 1
        self.messages.append({"role": "assistant", "content": f"step {self.turn}"})
        self.messages.append({"role": "user", "content": text(3000 + 100 * self.index
                                                              + self.turn, 120)})
        return out


def next_turns_at_once(url: str, convs: list[Conversation]) -> dict[int, dict]:
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(conv):
        try:
            results[conv.index] = conv.send(url)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in convs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def assert_only_new_tokens(results: dict[int, dict], when: str) -> None:
    for index, r in sorted(results.items()):
        assert r["cached"] >= r["prompt"] - r["new"] - PAGE, (when, index, r)


def test_first_turn_after_each_restart_reads_only_new_tokens(tiny_qwen3):
    kv_dir = short_tmp_dir("sykv")
    convs = [Conversation(i) for i in range(3)]
    try:
        group = ServerGroup(tiny_qwen3, slots=1, ctx=8192, kv_dir=kv_dir).start()
        try:
            for _ in range(2):
                for conv in convs:
                    conv.send(group.url)
            port = group.port
        finally:
            group.stop()
        # The whole group: SIGTERM, start again; send as soon as the port answers.
        group = ServerGroup(tiny_qwen3, slots=1, ctx=8192, kv_dir=kv_dir, port=port,
                            wait_for="none").start()
        try:
            assert_only_new_tokens(next_turns_at_once(group.url, convs), "group restart")
            group.wait_components()
            wait_ready(group)
            for role in ("worker", "kvstore", "scheduler", "gateway"):
                old = group.kill(role, signal.SIGKILL)
                assert_only_new_tokens(next_turns_at_once(group.url, convs), f"{role} restart")
                wait_ready(group, role, group.wait_restarted(role, old))
        finally:
            group.stop()
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)


def test_a_restarted_gateway_still_renders_earlier_replies_as_generated(tiny_qwen3):
    """The gateway remembers the tokens it generated for each reply, so a resent history
    renders as what the KV holds (prefix-stable). The tiny model's replies do not survive
    decode + encode and Qwen3's template re-renders its last turn: rendered from text alone,
    the prompt would leave the KV at the first reply. After kill -9 of the gateway, each
    conversation's next turn still reuses all of its previous prompt and reply."""
    kv_dir = short_tmp_dir("sykvj")
    try:
        with ServerGroup(tiny_qwen3, slots=3, ctx=4096, kv_dir=kv_dir) as group:
            convs = [[{"role": "system", "content": text(4000 + i, 120)},
                      {"role": "user", "content": text(5000 + i, 60)}] for i in range(3)]
            last: dict[int, tuple[int, int]] = {}  # conversation -> (prompt, completion)

            def turn(i: int) -> tuple[int, int]:
                resp = httpx.post(f"{group.url}/v1/chat/completions", timeout=120, json={
                    "messages": convs[i], "max_tokens": 24, "temperature": 0})
                assert resp.status_code == 200, resp.text
                data = resp.json()
                usage = data["usage"]
                convs[i] += [{"role": "assistant",
                              "content": data["choices"][0]["message"]["content"]},
                             {"role": "user", "content": text(6000 + 10 * i + len(convs[i]),
                                                              40)}]
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if i in last:  # all of the previous prompt and reply (but its last token)
                    prompt, completion = last[i]
                    assert cached >= prompt + completion - 1, (i, cached, last[i])
                last[i] = (usage["prompt_tokens"], usage["completion_tokens"])
                return cached, usage["prompt_tokens"]

            for _ in range(2):
                for i in range(3):
                    turn(i)
            old = group.kill("gateway", signal.SIGKILL)
            wait_ready(group, "gateway", group.wait_restarted("gateway", old))
            for i in range(3):
                turn(i)
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)
