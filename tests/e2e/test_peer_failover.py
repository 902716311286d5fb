"""Failover drill: SMG in front of two servers that are `--peer`s of each other, with the health
checks docs/operations.md "Pages from a peer" gives for a quick failover. One server is killed
mid-session; once SMG's worker list says it is unhealthy (polled, not slept on), every
conversation goes on through SMG on the other server and no request fails; a conversation the
survivor held continues from its own pages, and one the dead server held is re-read once (no
live peer holds it).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai

from tests.e2e.test_router_smg import (MODEL, PAGE_SIZE, SYSTEM, TIMEOUT_S, peer_servers,  # noqa: F401
                                       server_of, smg_exe)
from switchyard.testing.group import short_tmp_dir, start_all, stop_all
from switchyard.testing.smg import SmgRouter

HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
          "--health-check-timeout-secs", "1")


def worker_healthy(router: SmgRouter, url: str) -> bool | None:
    """SMG's view of worker `url`: True, False, or None when it is not listed."""
    body = httpx.get(router.url + "/workers", timeout=5).json()
    workers = body.get("workers", body) if isinstance(body, dict) else body
    for worker in workers or ():
        if isinstance(worker, dict) and worker.get("url", "").rstrip("/") == url:
            return bool(worker.get("is_healthy", worker.get("healthy", True)))
    return None


def test_a_killed_server_s_conversations_go_on_on_its_peer(tiny_qwen3, smg_exe):  # noqa: F811
    groups = peer_servers(tiny_qwen3)
    try:
        start_all(groups)
        with SmgRouter(smg_exe, [g.url for g in groups], short_tmp_dir("smg") / "smg.log",
                       extra=HEALTH) as router, \
                openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=TIMEOUT_S,
                              max_retries=0) as client:
            convs, homes, firsts = {}, {}, {}
            for name in ("a", "b", "c"):
                convs[name] = [{"role": "system", "content": f"Agent {name}. " + SYSTEM},
                               {"role": "user", "content": f"Task {name}."}]
                reply = client.chat.completions.create(model=MODEL, messages=convs[name],
                                                       max_tokens=4, temperature=0)
                homes[name], firsts[name] = server_of(groups, reply.id), reply.usage
                convs[name].append({"role": "assistant",
                                    "content": reply.choices[0].message.content})
                convs[name].append({"role": "user", "content": "Go on."})
            dead = homes["c"]
            survivor = next(g for g in groups if g is not dead)
            assert worker_healthy(router, dead.url) is True  # SMG's list is read right
            os.killpg(dead.supervisor_pid, signal.SIGKILL)  # the whole server, at once
            dead.proc.wait(30)
            deadline = time.monotonic() + 60
            while worker_healthy(router, dead.url) not in (False, None):
                assert time.monotonic() < deadline, httpx.get(router.url + "/workers").text
                time.sleep(0.2)
            for name, messages in convs.items():  # none fails once SMG noticed
                reply = client.chat.completions.create(model=MODEL, messages=messages,
                                                       max_tokens=4, temperature=0)
                assert reply.choices[0].finish_reason in ("stop", "length"), name
                assert server_of([survivor], reply.id) is survivor
                if homes[name] is survivor:  # its own pages: nothing of it re-read
                    cached = reply.usage.prompt_tokens_details.cached_tokens
                    assert cached >= firsts[name].prompt_tokens - PAGE_SIZE, (name, reply.usage)
    finally:
        stop_all([g for g in groups if g.proc is not None and g.proc.poll() is None])
