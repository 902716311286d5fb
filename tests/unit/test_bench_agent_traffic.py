"""bench/agent_traffic.py's request shapes and bench/_plot.py's TTFT plot, without a server.

The bench's promise is that the three servers read the same tokens: Switchyard gets Anthropic
Messages bodies, the peers OpenAI chat bodies, and both must render as the bench's own
rendering. Here every request of a small Claude Code-shaped workload goes through the
gateway's own parsing and rendering and through a plain chat-template rendering of the peers'
body, and all three must give the same token ids (also with templates that drop a later
system message: its text then joins the user message before it, on every server); the
mid-conversation system message must be where Claude Code puts it, in every conversation, and each turn's prompt must extend the
previous one (what a prefix cache needs)."""

from __future__ import annotations

import argparse
import json
import struct

import pytest

from bench.agent_traffic_figures import ttft_points
from bench.agent_traffic_shapes import CORPUS, claude_code_shape
from bench.agent_traffic_workload import Workload, anthropic_body, openai_body, prepare
from fixtures.chat_formats import write_tokenizer
from switchyard.gateway.api.anthropic_api import parse_messages_request
from switchyard.gateway.output.formats import detect_format
from switchyard.gateway.prompting.history import RenderOptions, render_prompt
from switchyard.gateway.prompting.system_turns import renders_system_in_place
from switchyard.gateway.prompting.tool_text import text_syntax
from switchyard.common.tokenizer_loading import load_tokenizer


def workload(tokenizer, shape: str) -> Workload:
    args = argparse.Namespace(seed=0, shape=shape, system=600 if shape == "synthetic" else None,
                              agents=2, turns=2, grow_to=26000, reply=8)
    return Workload(args, tokenizer)


def gateway_ids(tokenizer, body: dict) -> list[int]:
    """The prompt Switchyard's Anthropic route renders for `body` (as gateway/app.py sets up)."""
    chat = parse_messages_request(body).chat
    options = RenderOptions(memory=None, think_start="<think>", turn_ends=("<|im_end|>",),
                            tools_as_text=text_syntax(tokenizer, detect_format(tokenizer).tools),
                            system_in_place=renders_system_in_place(tokenizer))
    return render_prompt(tokenizer, chat.messages, chat.tools, chat.template_kwargs,
                         options).ids


def peer_ids(tokenizer, body: dict) -> list[int]:
    """What a peer renders of its body: the chat template of its messages and tools."""
    text = tokenizer.apply_chat_template(body["messages"], tools=body.get("tools"),
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("shape", ["claude-code", "synthetic"])
def test_every_server_reads_the_same_tokens(tiny_hf_tokenizer, shape):
    w = workload(tiny_hf_tokenizer, shape)
    reqs = prepare(w, ctx=1 << 20)
    for n, r in enumerate(reqs.values()):
        ours = gateway_ids(tiny_hf_tokenizer, anthropic_body(w, r.messages, n))
        assert ours == r.prompt_ids, f"{r.conv} turn {r.turn}: switchyard renders otherwise"
        peer = peer_ids(tiny_hf_tokenizer, openai_body(w, r.messages, "model"))
        assert peer == r.prompt_ids, f"{r.conv} turn {r.turn}: a peer renders otherwise"


@pytest.mark.parametrize("family", ["gpt_oss", "mistral", "deepseek_v31"])
def test_a_template_that_drops_a_later_system_message_gets_its_text_in_place(tmp_path, family):
    """These templates drop or hoist the system message: the gateway joins its text to the
    user message before it, and the peers must be sent that same equivalent."""
    tokenizer = load_tokenizer(str(write_tokenizer(tmp_path / family, family)))
    assert not renders_system_in_place(tokenizer)
    w = workload(tokenizer, "claude-code")
    for n, r in enumerate(prepare(w, ctx=1 << 20).values()):
        body = openai_body(w, r.messages, "model")
        assert [m["role"] for m in body["messages"]].count("system") <= 1
        assert w.shape.mid_system_text in body["messages"][1]["content"]
        assert gateway_ids(tokenizer, anthropic_body(w, r.messages, n)) == r.prompt_ids
        assert peer_ids(tokenizer, body) == r.prompt_ids


def test_the_claude_code_shape_is_the_corpus_request(tiny_hf_tokenizer):
    recorded = json.loads((CORPUS / "turn1.json").read_text())["body"]
    w = workload(tiny_hf_tokenizer, "claude-code")
    reqs = prepare(w, ctx=1 << 20)
    body = anthropic_body(w, reqs[("agent 1", 2)].messages, 7)
    assert body["tools"] == recorded["tools"]  # all of them, as recorded
    assert body["system"][1:] == recorded["system"][1:]
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    for r in reqs.values():  # Claude Code's system message right after the first user message
        sent = anthropic_body(w, r.messages, 0)["messages"]
        assert [m["role"] for m in sent[:2]] == ["user", "system"], r.conv
        assert sent[1] == recorded["messages"][1]
        assert sum(m["role"] == "system" for m in sent) == 1
        assert sent[0]["content"][:-1] == recorded["messages"][0]["content"][:-1]
    names = {t["name"] for t in recorded["tools"]}
    calls = [c for r in reqs.values() for m in r.messages for c in m.calls]
    assert calls and {c.name for c in calls} <= names  # only tools the client has
    # Each conversation's prompts grow turn by turn, and a sub-agent's first prompt shares
    # the system prompt and tools with the main session's.
    for r in reqs.values():
        prev = reqs.get((r.conv, r.turn - 1))
        if prev is not None:
            assert r.prompt_ids[:len(prev.prompt_ids)] == prev.prompt_ids
        if r.conv != "main":  # new: the growth past the main session's first prompt
            assert 0 < r.new < len(r.prompt_ids) // 2
    assert len(reqs[("agent 1", 2)].prompt_ids) > len(reqs[("agent 1", 0)].prompt_ids) + 1000


def test_a_shape_whose_corpus_lost_its_system_message_is_refused(tmp_path):
    record = json.loads((CORPUS / "turn1.json").read_text())
    del record["body"]["messages"][1]
    (tmp_path / "turn1.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="then a system message"):
        claude_code_shape(tmp_path)


def test_the_ttft_plot_is_a_png_of_the_set_size(tmp_path):
    pytest.importorskip("matplotlib", reason="the bench extra: pip install -e '.[bench]'")
    from PIL import Image

    from bench._plot import HEIGHT, WIDTH, plot_ttft

    series = {"switchyard": [(0.1 * i, 0.5 + 0.01 * i) for i in range(40)],
              "mlx_lm.server": [(0.1 * i, 0.5 + 0.05 * i) for i in range(40)],
              "vllm-mlx": []}
    path = plot_ttft(series, tmp_path / "sub" / "ttft.png", "synthetic figures")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (WIDTH, HEIGHT)
    with Image.open(path) as image:
        image.load()  # decodes
        assert image.size == (WIDTH, HEIGHT)
        assert len(image.convert("RGB").getcolors(WIDTH * HEIGHT)) > 10  # something drawn
    with pytest.raises(ValueError, match="no series"):
        plot_ttft({}, tmp_path / "empty.png")


def test_ttft_points_start_at_the_first_request():
    class Res:
        def __init__(self, sent, ttft):
            self.sent, self.ttft = sent, ttft

    class D:
        def __init__(self, sent, ttft):
            self.res = Res(sent, ttft)

    assert ttft_points([D(12.0, 0.5), D(10.0, 2.0)]) == [(0.0, 2.0), (2.0, 0.5)]
