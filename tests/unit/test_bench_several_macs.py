"""bench/several_macs.py's pure parts: each server's --peer flags, the agents' tool-call turns
that SMG accepts, and the check for a server without --peer."""

from bench.multi_agent import Agent
from bench.several_macs import ToolAgent, lists_peer_flag, opened, peer_flags


def test_each_server_points_at_the_other():
    assert peer_flags([8001, 8002], peer=True) == [["--peer", "http://127.0.0.1:8002"],
                                                    ["--peer", "http://127.0.0.1:8001"]]
    assert peer_flags([8001, 8002], peer=False) == [[], []]


def test_a_server_without_peer_is_told_from_one_with_it():
    assert not lists_peer_flag("  [--peer-timeout-s PEER_TIMEOUT_S]\n  --peer-timeout-s S  ...")
    assert lists_peer_flag("  [--peer URL] [--peer-timeout-s S]")
    assert lists_peer_flag("  --peer URL   a server to fetch KV pages from")


def test_every_tool_message_answers_a_call_and_each_run_opens_its_own_prompts():
    agents = [Agent(i, "Shared system.", f"Task {i}.", ["result 0", "result 1"]) for i in (0, 1)]
    runs = {p: opened(agents, p) for p in ("cache_aware", "round_robin")}
    msgs = runs["cache_aware"][1].messages(2)
    assert isinstance(runs["cache_aware"][1], ToolAgent)
    calls = [c["id"] for m in msgs if m["role"] == "assistant" for c in m["tool_calls"]]
    answers = [m["tool_call_id"] for m in msgs if m["role"] == "tool"]
    assert calls == answers == ["call_1_0", "call_1_1"]
    assert [m["content"] for m in msgs if m["role"] == "tool"] == ["result 0", "result 1"]
    first = {p: a[0].messages(0)[0]["content"] for p, a in runs.items()}
    assert first["cache_aware"] != first["round_robin"]
    assert runs["cache_aware"][0].system == runs["cache_aware"][1].system  # shared prefix
    own = opened(agents, "cache_aware", own_system=True)
    assert own[0].system[:8] != own[1].system[:8]  # no prefix shared from the first word
