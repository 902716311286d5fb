"""Fair shares between tenants through a real group: the 100-stream shut-out. With two keys
in the key file, bob opens 100 long streams; every one past bob's share of the running
requests and the queue is a 429 with Retry-After, and alice, from the same loopback host, is
still served: a 200 and her first token within a few seconds, interactive or background.
Before, bob's streams filled the slots and the queue and every request of alice's was a 429
(or, with the queue not full, waited for one of bob's streams to end).

The trigger is the group's state, not a clock: alice asks once each of bob's 100 requests
has its answer (a 429, or a stream's headers), so bob holds every slot and queue place then.
Bob's streams cannot end meanwhile (no end-of-text token, thousands of tokens to go); they are
closed at the end."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest

from switchyard.testing.group import ServerGroup, short_tmp_dir

ALICE_KEY = "e2e-alice-key-3c1d"
BOB_KEY = "e2e-bob-key-8e2f"
MODEL = "tiny-qwen3"
NUM_STREAMS = 100
MAX_RUNNING, MAX_QUEUE = 4, 8
FIRST_TOKEN_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def group(tiny_qwen3):
    kv_dir, keys = short_tmp_dir("sykv"), short_tmp_dir("sykeys")
    key_file = keys / "api-keys"
    key_file.write_text(f"alice {ALICE_KEY}\nbob {BOB_KEY}\n")
    key_file.chmod(0o600)
    running = ServerGroup(tiny_qwen3, slots=2, ctx=4096, kv_dir=kv_dir,
                          extra=("--api-key-file", str(key_file),
                                 "--max-running", str(MAX_RUNNING),
                                 "--max-queue", str(MAX_QUEUE)))
    with running:
        yield running
    subprocess.run(["rm", "-rf", str(kv_dir), str(keys)], check=False)


@pytest.fixture(scope="module")
def end_ids(tiny_hf_tokenizer):
    """Token ids that would end a reply: banned from bob's streams, so none ends early."""
    ids = {tiny_hf_tokenizer.eos_token_id,
           *tiny_hf_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


class Flood:
    """Bob's streams, each on a thread of its own, held open until `stop`."""

    def __init__(self, url: str, end_ids: list[int]) -> None:
        self.url, self.answers = url, []
        self.body = {"model": MODEL, "prompt": "Count on and on:", "max_tokens": 4000,
                     "temperature": 0.8, "stream": True,
                     "logit_bias": {str(i): -100 for i in end_ids}}
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._stream, daemon=True)
                        for _ in range(NUM_STREAMS)]

    def _stream(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120,
                              headers={"Authorization": f"Bearer {BOB_KEY}"}) as reply:
                with self.lock:
                    self.answers.append((reply.status_code, reply.headers.get("retry-after")))
                if reply.status_code == 200:
                    for _ in reply.iter_lines():
                        if self.done.is_set():
                            return
        except httpx.HTTPError as error:
            with self.lock:
                self.answers.append((None, repr(error)))

    def __enter__(self) -> Flood:
        for thread in self.threads:
            thread.start()
        deadline = time.monotonic() + 120
        while len(self.answers) < NUM_STREAMS and time.monotonic() < deadline:
            time.sleep(0.05)  # each answer comes at once, or with a stream's first keepalive
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(60)


def first_token_s(group, key: str, **extra) -> tuple[int, float | None]:
    """(status, seconds to the first streamed token) of a short completion of `key`'s."""
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "temperature": 0,
            "stream": True, **extra}
    began = time.monotonic()
    with httpx.stream("POST", group.base_url + "/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as reply:
        if reply.status_code != 200:
            reply.read()
            return reply.status_code, None
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return 200, time.monotonic() - began
    return 200, None


def test_one_keys_hundred_streams_leave_another_key_served(group, end_ids):
    alone = first_token_s(group, ALICE_KEY)
    assert alone[0] == 200
    with Flood(group.url, end_ids) as flood:
        statuses = [status for status, _ in flood.answers]
        assert statuses.count(200) == MAX_RUNNING + MAX_QUEUE, flood.answers
        refused = [after for status, after in flood.answers if status == 429]
        assert len(refused) == NUM_STREAMS - MAX_RUNNING - MAX_QUEUE, flood.answers
        assert all(after and int(after) > 0 for after in refused)
        beside = first_token_s(group, ALICE_KEY)
        background = first_token_s(group, ALICE_KEY, priority="background")
        bob_more = first_token_s(group, BOB_KEY)
        print(f"alice's first token: alone {alone[1]:.3f} s; beside bob's {NUM_STREAMS} "
              f"streams {beside}, background {background}; bob's next request {bob_more}")
        assert beside[0] == 200 and beside[1] < FIRST_TOKEN_WITHIN_S, beside
        assert background[0] == 200 and background[1] < FIRST_TOKEN_WITHIN_S, background
        assert bob_more[0] == 429  # over his share: bob, not alice, is refused
        # alice took a slot of bob's (he resumes from his pages), none of his had ended
        preempted = group.wait_events("request.preempted", reason="slot", role="scheduler")
        assert preempted, "alice was not given a share of the running requests"
        assert len(flood.answers) == NUM_STREAMS and not flood.done.is_set()
