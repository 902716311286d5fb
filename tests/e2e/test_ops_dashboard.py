"""The dashboard in a real headless Chromium against a real group (with an API key): after a
small workload the page shows the slots' conversations, the prompt tokens by source, a TTFT
plot with a point per recent request, by cause, and a timeline of the recent requests with a
lane per conversation; without the key it asks for one.

Needs Debian's `chromium` (.ci/run installs it); skips without it. Set SWITCHYARD_DASHBOARD_PNG
to a path to keep a screenshot there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest

from switchyard.proto.status import read_status
from switchyard.testing.group import ServerGroup
from switchyard.testing.workload import wait_written

API_KEY = "dash-key"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM = next((path for path in map(shutil.which, BROWSERS) if path), None)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless Chromium (apt-get install chromium; .ci/run does)")


class Dom(HTMLParser):
    """Elements of a dumped DOM: (tag, attributes, text directly inside)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict, list[str]]] = []
        self._open: list[tuple[str, dict, list[str]]] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        element = (tag, dict(attrs), [])
        self.elements.append(element)
        if tag not in ("meta", "link", "br", "input", "img"):
            self._open.append(element)

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._open:
            self._open[-1][2].append(data)

    def find(self, tag: str, **attrs) -> list[tuple[str, dict, list[str]]]:
        return [e for e in self.elements if e[0] == tag and all(
            (e[1].get(k.replace("_", "-")) == v if v is not True
             else k.replace("_", "-") in e[1]) for k, v in attrs.items())]

    def text_of(self, element_id: str) -> str:
        return "".join(next(e for e in self.elements if e[1].get("id") == element_id)[2])


def chromium(*args: str, user_data_dir: Path) -> subprocess.CompletedProcess:
    # Not with the test's LD_PRELOAD (OpenBLAS): Chromium's GPU process dies of it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
               "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
               f"--user-data-dir={user_data_dir}", "--virtual-time-budget=5000", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Conversation {i}: " + "describe a railway yard " * 10}]


def turn(client, model, messages):
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Go on."}]


def test_dashboard_in_headless_chromium(tiny_qwen3, tmp_path):
    extra = ("--page-size", "16", "--api-key", API_KEY)
    with ServerGroup(tiny_qwen3, slots=2, ctx=2048, extra=extra) as group:
        client = openai.OpenAI(base_url=group.base_url, api_key=API_KEY)
        model = client.models.list().data[0].id
        convs = [conversation(i) for i in range(3)]
        for messages in convs:  # prefilled
            turn(client, model, messages)
        turn(client, model, convs[2])  # reused: still in its slot
        wait_written(group, 1, time.time())  # its pages reached the disk
        turn(client, model, convs[0])  # restored: it lost its slot
        status_file = group.runtime_dir / "status.json"

        def recent() -> int:
            status = read_status(status_file)
            return len(status.stats.recent_requests) if status else 0

        deadline = time.monotonic() + 20
        while recent() < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        status = read_status(status_file)
        assert len(status.stats.recent_requests) == 5

        done = chromium("--dump-dom", f"{group.url}/dashboard#key={API_KEY}",
                        user_data_dir=tmp_path / "profile")
        assert done.returncode == 0, done.stderr[-3000:]
        dom = Dom(done.stdout)
        assert int(dom.find("body")[0][1].get("data-rendered", "0")) >= 1, done.stdout[:3000]
        assert dom.text_of("state") == "live"
        rows = dom.find("tr", data_slot=True)
        assert [r[1]["data-slot"] for r in rows] == ["0", "1"]
        shown = {"".join(e[2]) for e in dom.find("code")}
        resident = {s.conversation for s in status.slots if s.conversation}
        assert resident and resident <= shown
        points = dom.find("circle", data_cause=True)
        assert len(points) == 5
        assert [p[1]["data-cause"] for p in points] == [
            "prefilled", "prefilled", "prefilled", "reused", "restored"]
        assert all(float(p[1]["data-ttft"]) > 0 for p in points)
        segments = {e[1]["data-kind"] for e in dom.find("rect", data_kind=True)}
        assert {"prefilled", "reused", "used"} <= segments
        assert "of 32.0 GiB" in dom.text_of("disk-summary")
        # The timeline: a lane per conversation (the two that came back are one lane each
        # with both their requests), a bar per request, split by where its prompt came from.
        recent = status.stats.recent_requests
        conversations = {r.conversation for r in recent}
        assert len(conversations) == 3 and "" not in conversations
        lanes = dom.find("g", data_conversation=True)
        assert {lane[1]["data-conversation"] for lane in lanes} == conversations
        bars = dom.find("g", data_rid=True)
        assert sorted(b[1]["data-rid"] for b in bars) == sorted(r.rid for r in recent)
        parts = {e[1]["data-part"] for e in dom.find("rect", data_part=True)}
        assert {"prefilled", "reused", "restored", "decoded"} <= parts

        # Without the key, the page asks for it and shows no data.
        done = chromium("--dump-dom", f"{group.url}/dashboard", user_data_dir=tmp_path / "p2")
        locked = Dom(done.stdout)
        assert locked.text_of("state") == "API key needed"
        assert "hidden" not in locked.find("form", id="key-form")[0][1]
        assert not locked.find("circle")

        png = tmp_path / "dashboard.png"
        done = chromium("--window-size=1280,1200", f"--screenshot={png}",
                        f"{group.url}/dashboard#key={API_KEY}", user_data_dir=tmp_path / "p3")
        assert done.returncode == 0, done.stderr[-3000:]
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
        keep = os.environ.get("SWITCHYARD_DASHBOARD_PNG")
        if keep:
            shutil.copyfile(png, keep)
