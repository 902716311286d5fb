"""Abusive requests by class, and a well-behaved client to run beside them.

Used by tests/e2e/test_abuse.py (small sizes, in CI) and bench/abuse.py (full sizes).
Each class is a generator of `Payload`s; `send` answers the status (None for a request sent and
abandoned: a disconnect storm). `WellBehaved` sends a small chat on a timer and records every
reply's correctness and time to first token.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

USER = {"role": "user", "content": "hi"}


@dataclass(frozen=True)
class Payload:
    name: str
    path: str
    body: bytes
    abandon: bool = False  # send it all, then close the connection without reading
    refused: bool = True  # a 4xx is the only right answer (else a normal reply may be)

    def send(self, base_url: str, timeout_s: float = 120.0) -> int | None:
        if self.abandon:
            send_and_close(base_url, self.path, self.body)
            return None
        response = httpx.post(base_url + self.path, content=self.body, timeout=timeout_s,
                              headers={"content-type": "application/json"})
        return response.status_code


def _json(name: str, path: str, body: dict, **kw) -> Payload:
    return Payload(name, path, json.dumps(body).encode(), **kw)


def send_and_close(base_url: str, path: str, body: bytes) -> None:
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (path.encode(), url.hostname.encode(),
                                                      len(body)) + body)


# --- the classes ---------------------------------------------------------------------------------


def template_bombs(scale: int = 1) -> Iterator[Payload]:
    """A request's own chat template (refused), and template variables that are too big."""
    for i, bomb in enumerate(['{{ "ab " * 3000 }}',
                              "{% for i in range(100000) %}{% for j in range(2000) %}x"
                              "{% endfor %}{% endfor %}",
                              '{{ "abcd" * 200000000 }}']):
        yield _json(f"kwargs.chat_template {i}", "/v1/chat/completions", {
            "messages": [USER], "max_tokens": 4, "chat_template_kwargs": {"chat_template": bomb}})
        yield _json(f"chat_template {i}", "/v1/chat/completions",
                    {"messages": [USER], "max_tokens": 4, "chat_template": bomb})
    yield _json("kwargs value", "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4,
        "chat_template_kwargs": {"enable_thinking": "x" * (100_000 * scale)}})


def pattern_schema(num_patterns: int) -> dict:
    return {"type": "object", "additionalProperties": False, "patternProperties": {
        f"^p{i}_[a-z]+[0-9]*$": {"type": "integer"} for i in range(num_patterns)}}


def schema_blowups(patterns: tuple[int, ...] = (300, 450, 600)) -> Iterator[Payload]:
    """patternProperties (300: 5.6 s, 600: 105 s of validation before), in every API's field,
    as strict tool parameters, and a 100,000-option guided_choice."""
    salt = time.monotonic_ns()  # a new schema each time: the refusal cache is not what answers
    for n in patterns:
        schema = pattern_schema(n)
        schema["description"] = f"{salt}-{n}"
        yield _json(f"response_format {n}", "/v1/chat/completions", {
            "messages": [USER], "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "b", "schema": schema}}})
    schema = {**pattern_schema(450), "description": f"{salt}-r"}
    yield _json("text.format", "/v1/responses", {"input": "hi", "max_output_tokens": 4,
                                                 "text": {"format": {
                                                     "type": "json_schema", "name": "b",
                                                     "schema": schema}}})
    schema = {**pattern_schema(450), "description": f"{salt}-m"}
    yield _json("output_format", "/v1/messages", {
        "messages": [USER], "max_tokens": 4,
        "output_format": {"type": "json_schema", "schema": schema}})
    schema = {**pattern_schema(450), "description": f"{salt}-t"}
    yield _json("strict tool", "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "strict": True,
                                              "parameters": schema}}]})
    yield _json("guided_choice", "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4,
        "guided_choice": [f"option {i}" for i in range(100_000)]})


def huge_tools(scale: int = 1) -> Iterator[Payload]:
    """Many tools, and tool text far longer than the context."""
    def tools(n: int, description: str) -> list[dict]:
        return [{"type": "function", "function": {"name": f"t{i}", "description": description,
                                                  "parameters": {"type": "object"}}}
                for i in range(n)]

    yield _json("600 tools", "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4, "tools": tools(600, "d")})
    yield _json("5 MB description", "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4, "tools": tools(1, "d" * (5_000_000 * scale))})
    yield _json("500 x 10 KB", "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4, "tools": tools(500, "d" * 10_000 * scale)})
    yield _json("anthropic 5 MB", "/v1/messages", {
        "messages": [USER], "max_tokens": 4,
        "tools": [{"name": "t", "description": "d" * (5_000_000 * scale)}]})
    yield _json("count_tokens 5 MB", "/v1/messages/count_tokens", {
        "messages": [{"role": "user", "content": "w " * (2_500_000 * scale)}]})


def many_messages(count: int = 1_100_000) -> Iterator[Payload]:
    """Empty messages by the million (32 MB took 47 s before), in every API's list."""
    empty = ',{"role":"user","content":""}'
    items = ("[" + empty[1:] + empty * (count - 1) + "]").encode()
    yield Payload("chat messages", "/v1/chat/completions",
                  b'{"max_tokens": 4, "messages": ' + items + b"}")
    yield Payload("responses input", "/v1/responses",
                  b'{"max_output_tokens": 4, "input": ' + items + b"}")
    yield Payload("anthropic messages", "/v1/messages",
                  b'{"max_tokens": 4, "messages": ' + items + b"}")
    yield Payload("count_tokens", "/v1/messages/count_tokens", b'{"messages": ' + items + b"}")
    yield Payload("one message, many parts", "/v1/chat/completions",
                  b'{"max_tokens": 4, "messages": [{"role": "user", "content": ['
                  + b",".join([b'{"type":"text","text":""}'] * (count // 4)) + b"]}]}",
                  refused=False)  # newlines, which may fit the context


def raw_bytes(scale: int = 1) -> Iterator[Payload]:
    """Bodies that are not text: encoded surrogates, invalid UTF-8, UTF-16, control bytes."""
    for path, fields in (("/v1/chat/completions", b'"messages": [{"role": "user", "content": '),
                         ("/v1/completions", b'"prompt": '),
                         ("/v1/responses", b'"input": '),
                         ("/v1/messages", b'"max_tokens": 4, "messages": [{"role": "user", '
                                          b'"content": '),
                         ("/v1/messages/count_tokens", b'"messages": [{"role": "user", '
                                                       b'"content": ')):
        close = b"}]" if b"messages" in fields else b""
        for label, text in (("surrogate", b'"hi \xed\xa0\x80"'), ("invalid", b'"\xff\xfe"'),
                            ("overlong", b'"\xc0\xaf"'), ("escaped", b'"\\udfff"')):
            yield Payload(f"{path} {label}", path, b"{" + fields + text + close + b"}")
    yield Payload("utf-16", "/v1/chat/completions",
                  json.dumps({"messages": [USER], "max_tokens": 4}).encode("utf-16"),
                  refused=False)  # JSON may be UTF-16 (RFC 8259 asks for UTF-8)
    yield Payload("nul and controls", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "\u0000\u0001\u001b[2J" * 100}],
         "max_tokens": 4}).encode(), refused=False)


def disconnect_storm(count: int = 3, size: int = 5_000_000) -> Iterator[Payload]:
    """Large prompts sent, then the connection closed before the answer (3 of these took the
    gateway to 5.1 GB before)."""
    for i in range(count):
        yield _json(f"abandoned {i}", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "w " * (size // 2)}], "max_tokens": 4},
            abandon=True)
        yield _json(f"abandoned count {i}", "/v1/messages/count_tokens", {
            "messages": [{"role": "user", "content": "w " * (size // 2)}]}, abandon=True)


CLASSES: dict[str, Callable[..., Iterator[Payload]]] = {
    "template bombs": template_bombs, "schema blow-ups": schema_blowups,
    "huge tool lists": huge_tools, "many messages": many_messages, "raw-byte encodings": raw_bytes,
    "disconnect storms": disconnect_storm}


# --- the well-behaved client --------------------------------------------------------------------


@dataclass
class WellBehaved:
    """A small streamed chat every `every_s` seconds; each reply must equal `expected`."""

    base_url: str
    every_s: float = 1.0
    expected: str | None = None
    ttfts: list[float] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    BODY = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0, "seed": 1, "stream": True}

    def once(self) -> tuple[str, float]:
        started = time.monotonic()
        ttft, text = None, []
        with httpx.stream("POST", self.base_url + "/v1/chat/completions", json=self.BODY,
                          timeout=120) as response:
            if response.status_code != 200:
                return f"<status {response.status_code}>", time.monotonic() - started
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", ()):
                    piece = choice["delta"].get("content")
                    if piece:
                        ttft = ttft if ttft is not None else time.monotonic() - started
                        text.append(piece)
        return "".join(text), ttft if ttft is not None else time.monotonic() - started

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                text, ttft = self.once()
            except httpx.HTTPError as exc:
                text, ttft = f"<{type(exc).__name__}>", time.monotonic() - began
            self.ttfts.append(ttft)
            if text != self.expected:
                self.wrong.append(text)
            self._stop.wait(max(0.0, self.every_s - (time.monotonic() - began)))

    def replied_beyond(self, count: int, timeout_s: float = 120.0) -> bool:
        """Whether a reply more than `count` came (waits for it up to `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.ttfts) <= count and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.ttfts) > count

    def __enter__(self) -> "WellBehaved":
        if self.expected is None:
            self.expected, _ = self.once()  # alone, before anything else runs
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(180)


def p95(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=20, method="inclusive")[-1]
