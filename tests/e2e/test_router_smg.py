"""Two servers behind SMG (Shepherd Model Gateway, SGLang's router), installed from PyPI as its
users install it (testing/smg.py), on the tiny model: Chat, Messages and Responses answer
through it, streamed and not, with SGLang's integer priority (SMG itself adds one to Responses);
SMG's discovery and load monitor accept what the servers answer; a later turn of a conversation
sent through SMG's `cache_aware` policy reaches the server that holds it, and is cached. The two
servers are `--peer`s of each other: a turn that reaches the server that never saw its
conversation (a routing mistake, sent there directly) restores the conversation's pages from the
other instead of re-reading it, and a conversation under another cache salt (another tenant, as
pages know it) gets none of them (docs/design/kv-pages.md "Pages from a peer").

SMG routes by the name each server announces (`--served-model-name`). Without pip or an index
the tests skip with the reason, unless SWITCHYARD_REQUIRE_CLIENTS=1 (`.ci/run` sets it): then
they fail.
"""

from __future__ import annotations

import os
import time

import anthropic
import httpx
import openai
import pytest

from switchyard.testing.group import (ServerGroup, free_port, peer_pair, short_tmp_dir,
                                      start_all, stop_all)
from switchyard.testing.smg import SmgRouter, SmgUnavailable, install
from switchyard.testing.workload import wait_written

MODEL = "tiny"
CLAUDE_MODEL = "claude-sonnet-4-5"  # a name Claude Code sends, routed by SMG's --model-alias
PAGE_SIZE = 16
TIMEOUT_S = 120.0
# Long enough that a later turn's cached tokens say where it went (many pages of it).
SYSTEM = "You are a terse assistant for a team of agents. " * 12


@pytest.fixture(scope="module")
def smg_exe():
    try:
        return install()
    except SmgUnavailable as exc:
        if os.environ.get("SWITCHYARD_REQUIRE_CLIENTS") == "1":
            pytest.fail(f"SMG required (SWITCHYARD_REQUIRE_CLIENTS=1): {exc}")
        pytest.skip(f"SMG not installed: {exc}")


def peer_servers(model) -> list[ServerGroup]:
    """The two servers SMG fronts, each the other's `--peer` (not started)."""
    return peer_pair(model, extra=("--served-model-name", MODEL, "--page-size", str(PAGE_SIZE)))


@pytest.fixture(scope="module")
def servers(tiny_qwen3, smg_exe):
    groups = peer_servers(tiny_qwen3)
    try:
        start_all(groups)
        yield groups
    finally:
        stop_all(groups)


@pytest.fixture(scope="module")
def router(servers, smg_exe):
    log = short_tmp_dir("smg") / "smg.log"
    # Loads polled every second, not every 10 (SMG's default): test_smg_sees_the_servers_load
    # waits for the first poll.
    with SmgRouter(smg_exe, [g.url for g in servers], log,
                   extra=("--model-alias", f"{CLAUDE_MODEL}={MODEL}",
                          "--load-monitor-interval", "1")) as running:
        yield running


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(router):
    with anthropic.Anthropic(base_url=router.url, api_key="none", timeout=TIMEOUT_S,
                             max_retries=0) as c:
        yield c


def test_every_server_answers_what_smg_reads(servers):
    for group in servers:
        loads = httpx.get(group.url + "/v1/loads").json()
        assert loads["dp_rank_count"] == 1 and loads["loads"][0]["max_running_requests"] >= 2
        assert httpx.get(group.url + "/server_info").json()["served_model_name"] == MODEL
        assert httpx.get(group.url + "/model_info").json()["is_generation"] is True


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_smg(client, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello"}],
                  max_tokens=4, extra_body={"priority": 1})
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens > 0
        return
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") if chunks[-1].choices \
        else chunks[-2].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_messages_through_smg(claude, stream):
    kwargs = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                  extra_body={"priority": 0})
    if not stream:
        reply = claude.messages.create(**kwargs)
        assert reply.stop_reason in ("end_turn", "max_tokens") and reply.usage.output_tokens > 0
        return
    with claude.messages.stream(**kwargs) as events:
        final = events.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")


def test_claude_codes_model_name_routes_by_smgs_alias(claude):
    reply = claude.messages.create(model=CLAUDE_MODEL, max_tokens=4,
                                   messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_smg(client, stream):
    """SMG re-serializes a Responses body with SGLang's integer priority of its own."""
    kwargs = dict(model=MODEL, input="Hi", max_output_tokens=4, extra_body={"priority": -1})
    if not stream:
        reply = client.responses.create(**kwargs)
        assert reply.status in ("completed", "incomplete") and reply.usage.output_tokens > 0
        return
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_a_later_turn_through_smg_is_cached(client):
    """cache_aware sends the second turn where the first one's text is: its cached tokens
    cover the first prompt, less at most the page it ends in."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Plan the first step."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the next one?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                            temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - PAGE_SIZE, (first.usage, second.usage)


def test_smg_sees_the_servers_load(router, servers):
    """SMG's load monitor took each server's /v1/loads: its /get_loads lists both, with the
    figures they gave (max_running_requests is --max-running; a worker whose load SMG could
    not read is left out)."""
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(router.url + "/get_loads", timeout=10).json()
        seen = {w["worker"]: w for w in body.get("loads", [])}
        if set(seen) == {g.url for g in servers} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(seen) == {g.url for g in servers}, (body, router.log_tail())
    assert all(w["max_running_requests"] == 2 and w["max_total_num_tokens"] > 0
               for w in seen.values()), body


def test_the_router_units_smg_command_serves(servers, smg_exe):
    """`switchyard launchd|systemd install --router` runs exactly this command: SMG takes every
    flag it is given and routes through it."""
    from switchyard.deploy.router_unit import router_plan, smg_arguments
    from switchyard.common.settings import Settings

    port = free_port()
    plan = router_plan(Settings(port=port), [g.url for g in servers], smg=str(smg_exe),
                       model_aliases=[f"{CLAUDE_MODEL}={MODEL}"],
                       smg_args=["--prometheus-port", str(free_port())])  # beside the others
    unit = SmgRouter(smg_exe, [], short_tmp_dir("smg") / "smg-unit.log")
    unit.port, unit.url, unit.cmd = port, f"http://127.0.0.1:{port}", smg_arguments(plan)
    assert unit.cmd[unit.cmd.index("--prometheus-host") + 1] == "127.0.0.1"
    with unit:
        with anthropic.Anthropic(base_url=unit.url, api_key="none", timeout=TIMEOUT_S,
                                 max_retries=0) as c:
            reply = c.messages.create(model=CLAUDE_MODEL, max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.output_tokens > 0, unit.log_tail()


# -- tenants' keys through SMG (docs/operations.md "Behind a router (SMG)") -------------------------
# A server with two tenants' keys behind an SMG that has no key of its own: the module's two
# servers have none (their tests and SMG's load polls above read them without one).

KEYS = {"alice": "sk-alice-5e1f0c", "bob": "sk-bob-77d2a9"}


@pytest.fixture(scope="module")
def keyed(tiny_qwen3, smg_exe):
    key_dir = short_tmp_dir("keys")
    key_file = key_dir / "keys"
    key_file.write_text("".join(f"{name} {key}\n" for name, key in KEYS.items()))
    key_file.chmod(0o600)
    with ServerGroup(tiny_qwen3, slots=2, ctx=2048,
                     extra=("--served-model-name", MODEL, "--page-size", str(PAGE_SIZE),
                            "--api-key-file", str(key_file))) as group:
        with SmgRouter(smg_exe, [group.url], short_tmp_dir("smg") / "smg-keys.log") as router:
            yield group, router


def tenant_client(router: SmgRouter, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=KEYS[name], timeout=TIMEOUT_S,
                         max_retries=0)


def finished_by(group: ServerGroup, rid: str, timeout_s: float = 30.0) -> dict:
    """The gateway's `request.finished` line of the response `rid` (it names the tenant)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [e for e in group.log_events("request.finished")
                 if e.get("role") == "gateway" and e.get("rid") == rid]
        if lines or time.monotonic() > deadline:
            assert lines, f"no request.finished for {rid}:\n{group.log_tail()}"
            return lines[0]
        time.sleep(0.2)


def test_tenant_keys_pass_through_smg_unchanged(keyed):
    """SMG without --api-key forwards each client's key as it came, Bearer or x-api-key: the
    server names each tenant, and refuses a missing or wrong key in the API's own format."""
    group, router = keyed
    for name in KEYS:
        with tenant_client(router, name) as client:
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Hi from {name}"}],
                max_tokens=2)
        assert finished_by(group, reply.id).get("tenant") == name
    with anthropic.Anthropic(base_url=router.url, api_key=KEYS["bob"], timeout=TIMEOUT_S,
                             max_retries=0) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=2,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert finished_by(group, message.id).get("tenant") == "bob"
    for key in ("none", "sk-alice-5e1f0d"):
        with openai.OpenAI(base_url=router.url + "/v1", api_key=key, timeout=TIMEOUT_S,
                           max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError) as refused:
                stranger.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert refused.value.body["code"] == "invalid_api_key"


def test_one_tenant_cannot_read_anothers_state_through_smg(keyed):
    """Through the router, bob neither continues alice's stored response nor reuses her cached
    prompt, which SMG sends to the same server (her own repeat is cached)."""
    group, router = keyed
    with tenant_client(router, "alice") as alice, tenant_client(router, "bob") as bob:
        first = alice.responses.create(model=MODEL, input="Remember the code word.",
                                       max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="not found"):
            bob.responses.create(model=MODEL, input="What was it?", max_output_tokens=2,
                                 previous_response_id=first.id)
        assert alice.responses.create(model=MODEL, input="What was it?", max_output_tokens=2,
                                      previous_response_id=first.id).usage.output_tokens > 0
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Alice's private plan, step one."}]
        hers = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                             temperature=0)
        again = alice.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                              temperature=0)
        his = bob.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= \
        hers.usage.prompt_tokens - PAGE_SIZE, again.usage
    # (at most what his own earlier request shares with it: the template's first tokens)
    assert (his.usage.prompt_tokens_details.cached_tokens or 0) < PAGE_SIZE, his.usage
    assert finished_by(group, his.id).get("tenant") == "bob"


def server_of(servers, rid: str) -> ServerGroup:
    """The server that answered request `rid` (its scheduler logged it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for group in servers:
            if group.wait_events("request.finished", timeout_s=0, role="scheduler", rid=rid):
                return group
        time.sleep(0.1)
    raise AssertionError(f"no server logged {rid}")



@pytest.mark.parametrize("salt", ["same", "other"])
def test_a_turn_on_the_wrong_server_restores_from_its_peer(client, servers, salt):
    """Turn 1 through SMG; turn 2 sent straight to the other server, as a routing mistake
    would: it restores turn 1's pages from its peer and prefills at most one page beyond its
    new tokens. Under another cache salt (another tenant's chain) it gets nothing."""
    messages = [{"role": "system", "content": SYSTEM + salt},
                {"role": "user", "content": f"Plan the {salt} step."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                           temperature=0, extra_body={"cache_salt": "t1"})
    replied_at = time.time()
    home = server_of(servers, first.id)
    wrong = next(g for g in servers if g is not home)
    wait_written(home, first.usage.prompt_tokens // PAGE_SIZE, replied_at)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the next one?"}]
    with openai.OpenAI(base_url=wrong.base_url, api_key="none", timeout=TIMEOUT_S,
                       max_retries=0) as direct:
        second = direct.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0,
            extra_body={"cache_salt": "t1" if salt == "same" else "t2"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    new = second.usage.prompt_tokens - first.usage.prompt_tokens
    fetched = wrong.wait_events("peer.pages", role="scheduler", rid=second.id)
    assert fetched, wrong.log_tail()
    if salt == "same":
        assert second.usage.prompt_tokens - cached <= new + PAGE_SIZE, (first.usage,
                                                                         second.usage)
        assert fetched[0]["num_pages"] >= first.usage.prompt_tokens // PAGE_SIZE - 1
    else:
        assert cached == 0 and fetched[0]["num_pages"] == 0, (second.usage, fetched)
