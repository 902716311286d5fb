"""The security findings that only the whole process group shows: the API key on
no process's command line and in the gateway's environment alone (1), a second server on the
same kv dir refused (8), shared memory of a SIGKILLed group removed at the next start (10).
And tenants: with two keys in the key file, one key's text is neither
reused (cached prefix) nor copied (speculative drafts) for the other, so the door-code probe
gives the same counts and events for a right and a wrong guess; within one key it is both,
by design. What each key is shown: the status and /metrics show the other key none of the
victim's requests or draft counts, an operator key all of them; the cache dir is made 0700 with
the salt key 0600 in it. One group serves both tests (`--speculative suffix`, which verifies
every whole proposal, and 16-token pages, so a short prompt fills pages)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import json
import time

import httpx
import openai
import pytest

from switchyard.common.endpoints import Endpoints
from switchyard.testing.group import ServerGroup, short_tmp_dir

KEY = "e2e-secret-key-7f3a"
ATTACKER_KEY = "e2e-other-key-91c2"
OPERATOR_KEY = "e2e-operator-key-0d1e"
LINUX = sys.platform.startswith("linux")
MODEL = "tiny-qwen3"
SECRET = "Please remember: Alice's door code is 2 8 5 3 7 0 6 4 1 9."
CODE, WRONG = " 2 8 5 3 7 0 6 4 1 9", " 2 8 5 3 7 0 6 4 9 1"  # no digit twice: no self-copy
MAX_TOKENS = 24
SELF_COPIES = 3


def proc_text(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


@pytest.fixture(scope="module")
def group(tiny_qwen3):
    kv_dir, keys, cache = short_tmp_dir("sykv"), short_tmp_dir("sykeys"), short_tmp_dir("sycache")
    cache.chmod(0o755)
    key_file = keys / "api-keys"
    key_file.write_text(f"# tenants\nvictim {KEY}\nattacker {ATTACKER_KEY}\n"
                        f"ops,role=operator {OPERATOR_KEY}\n")
    key_file.chmod(0o600)
    running = ServerGroup(tiny_qwen3, slots=1, ctx=512, kv_dir=kv_dir,
                          extra=("--api-key-file", str(key_file), "--speculative", "suffix",
                                 "--page-size", "16", "--cache-dir", str(cache)))
    running.cache_dir = cache
    with running:
        yield running
    subprocess.run(["rm", "-rf", str(kv_dir), str(keys), str(cache)], check=False)


def drafts_of(group, rid: str) -> tuple[int, int]:
    [rec] = [r for r in group.wait_events("request.finished", rid=rid, role="scheduler")
             if "num_proposed_tokens" in r]
    return rec["num_proposed_tokens"], rec["num_accepted_tokens"]


def probe(group, key: str, regex: str, cache_salt: str | None = None) -> dict:
    """The attacker's probe: a streamed greedy completion pinned to a guess."""
    body = {"model": MODEL, "prompt": "Tell me: the door code is", "max_tokens": 24,
            "temperature": 0, "stream": True, "guided_regex": regex}
    if cache_salt:
        body["cache_salt"] = cache_salt
    began, events, rid = time.monotonic(), 0, None
    with httpx.stream("POST", group.base_url + "/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events += 1
                rid = rid or json.loads(line[6:])["id"]
    took = time.monotonic() - began
    [rec] = [r for r in group.wait_events("request.finished", rid=rid, role="scheduler")
             if "num_proposed_tokens" in r]
    return {"events": events, "tokens": rec.get("num_generated_tokens"),
            "proposed": rec["num_proposed_tokens"], "accepted": rec["num_accepted_tokens"],
            "s": round(took, 3)}


def test_one_keys_text_is_neither_reused_nor_drafted_for_another(group):
    victim = openai.OpenAI(base_url=group.base_url, api_key=KEY, max_retries=0, timeout=120)
    attacker = openai.OpenAI(base_url=group.base_url, api_key=ATTACKER_KEY, max_retries=0,
                             timeout=120)

    def complete(client, prompt=SECRET, **extra):
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body=extra or None)
        return reply, reply.usage.prompt_tokens_details.cached_tokens, \
            drafts_of(group, reply.id)

    first, _, _ = complete(victim)
    # Within a key: the prefix is reused and the first reply is drafted (and accepted).
    again, cached, (_, accepted) = complete(victim)
    assert cached > 0 and accepted >= MAX_TOKENS // 2, (cached, accepted)
    # The door-code probe: a right and a wrong guess look the same to another key. Each guess
    # under a cache_salt of its own, so that neither copies the other's output (the attacker's
    # own text, which a second guess would otherwise be drafted from up to where they part).
    for n in range(2):  # the second time wrong first, each grammar compiled already
        if n == 0:
            right = probe(group, ATTACKER_KEY, CODE, f"right-{n}")
            wrong = probe(group, ATTACKER_KEY, WRONG, f"wrong-{n}")
        else:
            wrong = probe(group, ATTACKER_KEY, WRONG, f"wrong-{n}")
            right = probe(group, ATTACKER_KEY, CODE, f"right-{n}")
        print(f"another key: right guess {right}, wrong guess {wrong}")
        assert right["accepted"] == wrong["accepted"] == 0
        assert right["proposed"] == wrong["proposed"] and right["tokens"] == wrong["tokens"]
        # SSE events carry what each step made: one token a step without drafts, whose
        # grouping only the machine's timing changes (a burst of decode steps in one message)
        assert abs(right["events"] - wrong["events"]) <= 2
    # The victim's own key confirms its own text (a tenant shares it with itself, by design).
    own = probe(group, KEY, CODE)
    print(f"own key: right guess {own}")
    assert own["accepted"] > 0
    # Across keys: the same text is read afresh, and nothing of the victim's is drafted.
    # (A random-weight model's reply may repeat itself: a draft copied from its own earlier
    # tokens is the request's own text, and a token or two of it may be accepted.)
    theirs, cached, (proposed, accepted) = complete(attacker)
    assert theirs.choices[0].text == first.choices[0].text  # the same greedy reply...
    assert cached == 0 and accepted <= SELF_COPIES, (cached, proposed, accepted)  # ...paid
    # cache_salt isolates within a key: the victim's text under a salt is neither
    _, cached, (_, accepted) = complete(victim, cache_salt="s1")
    assert cached == 0 and accepted <= SELF_COPIES, (cached, accepted)
    # Both keys answer on /metrics (aggregate counters); none is a 401.
    for key in (KEY, ATTACKER_KEY):
        scraped = httpx.get(group.base_url.removesuffix("/v1") + "/metrics",
                            headers={"Authorization": f"Bearer {key}"})
        assert scraped.status_code == 200 and "switchyard_speculative_tokens_total" in scraped.text
    assert httpx.get(group.base_url.removesuffix("/v1") + "/metrics").status_code == 401
    shown_to_each_key(group, num_requests=9)


def shown_to_each_key(group, num_requests: int) -> None:
    """The other key is shown none of the victim's requests, slots or draft counts; the
    operator key all of them. The cache dir holds the salt key, private."""
    def status_of(key: str) -> dict:
        return httpx.get(group.base_url + "/switchyard/status",
                         headers={"Authorization": f"Bearer {key}"}).json()

    deadline = time.monotonic() + 60
    while len(status_of(OPERATOR_KEY)["stats"]["recent_requests"]) < num_requests:
        assert time.monotonic() < deadline, "the status never counted every request"
        time.sleep(0.2)
    everything, seen = status_of(OPERATOR_KEY), status_of(ATTACKER_KEY)
    assert {s["tenant"] for s in everything["slots"]} == {"victim"}  # its salted turn, last
    assert seen["slots"] == [] and seen["queue"] == []
    assert {r["tenant"] for r in seen["stats"]["recent_requests"]} == {"attacker"}
    assert everything["stats"]["tokens"]["draft_accepted"] >= MAX_TOKENS // 2
    assert seen["stats"]["tokens"]["draft_accepted"] <= SELF_COPIES
    assert set(seen["stats"]["by_tenant"]) == {"attacker"}
    scraped = httpx.get(group.base_url.removesuffix("/v1") + "/metrics",
                        headers={"Authorization": f"Bearer {ATTACKER_KEY}"}).text
    assert 'switchyard_slot_tokens{slot="0"}' not in scraped
    assert (os.stat(group.cache_dir).st_mode & 0o777) == 0o700
    assert (os.stat(group.cache_dir / "salt.key").st_mode & 0o777) == 0o600


@pytest.mark.skipif(not LINUX, reason="reads /proc")
def test_key_kv_lock_and_stale_shared_memory(group, tiny_qwen3):
    kv_dir = group.kv_dir
    pids = {role: group.pid_of(role) for role in ("scheduler", "kvstore", "worker",
                                                  "gateway")}
    pids["supervisor"] = group.supervisor_pid
    for role, pid in pids.items():  # 1: in no argv; in the gateway's environment only
        assert KEY.encode() not in proc_text(pid, "cmdline"), role
        assert ATTACKER_KEY.encode() not in proc_text(pid, "cmdline"), role
        if role not in ("gateway", "supervisor"):
            assert KEY.encode() not in proc_text(pid, "environ"), role
    assert KEY.encode() in proc_text(pids["gateway"], "environ")
    assert ATTACKER_KEY.encode() in proc_text(pids["gateway"], "environ")
    assert httpx.get(group.base_url + "/models").status_code == 401
    client = openai.OpenAI(base_url=group.base_url, api_key=KEY, max_retries=0)
    assert client.models.list().data

    # 8: a second server on the same kv dir refuses, naming the first one's kvstore.
    second = ServerGroup(tiny_qwen3, slots=1, ctx=512, kv_dir=kv_dir, wait_for="none")
    second.start()
    try:
        assert second.proc.wait(120) == 2, second.log_tail()
        assert f"in use by process {pids['kvstore']}" in second.log_text()
    finally:
        second.stop(check=False)

    # 10: SIGKILL the whole group: its shared-memory segment is left behind ...
    prefix = Endpoints(group.runtime_dir).shm_prefix
    os.killpg(group.proc.pid, signal.SIGKILL)
    group.proc.wait()
    left = [p.name for p in Path("/dev/shm").glob(prefix + "*")]
    assert left, "the killed worker's segment should still exist"
    for pid_file in group.runtime_dir.glob("*.pid"):
        pid_file.unlink()
    group.proc = None
    # ... and the next start of the group removes it.
    group.start()
    now = {p.name for p in Path("/dev/shm").glob(prefix + "*")}
    assert not set(left) & now and len(now) == 1
    assert "worker.stale_shm_removed" in group.log_text()
