"""Refresh tests/corpus/: the requests real agent clients send, recorded through a proxy.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        .venv/bin/python tools/record_clients.py [--clients claude-code codex ...] [--keep-old]

Installs the clients at npm's newest versions (testing/agent_clients.py), starts a
server on the terse twin (`--model tiny-terse`, which ends its replies), puts a recording
proxy between each client and the server, and runs the client headless in a scratch HOME for
two turns of one session (the same prompts as tests/e2e/test_agent_clients.py). Every
model request a client sends is written to tests/corpus/<client>-<version>/ as JSON: method,
path, headers (auth headers removed), body, and the status the server answered. Kept: the
first and the second turn's main request (`turn1.json`, `turn2.json`, the largest request of
each turn: clients also send small side requests, titles and the like, which are dropped).
A third file, `tool_result.json`, is built from turn 1's request: the client's own shape of a
tool call and its result appended (the random twin rarely calls a tool, so it is constructed,
and says so in its `constructed` field).

    .venv/bin/python tools/record_clients.py --proxy-only --upstream http://127.0.0.1:8000 \
        --port 8100 --out /tmp/requests       # just the proxy: point any client at :8100
"""

from __future__ import annotations

import argparse
import copy
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from switchyard.testing.agent_clients import CLIENTS, install

REPO = Path(__file__).resolve().parents[1]

CORPUS = REPO / "tests" / "corpus"
SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
               "proxy-connection", "te", "trailer", "upgrade", "accept-encoding"}
PROMPTS = ("Say hello in one short sentence.", "Now say goodbye in one short sentence.")


class RecordingProxy:
    """A ThreadingHTTPServer on 127.0.0.1 that writes each request (method, path, headers
    without secrets, JSON body) to `<out>/NNNN.json` and forwards it to `upstream`, streaming
    the answer back (chunked). The record gains the answer's `status` once it is known."""

    def __init__(self, upstream: str, out: Path, port: int = 0) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = proxy.record(self.command, self.path, self.headers, body)
                proxy.forward(self, body, path)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "RecordingProxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def record(self, method: str, path: str, headers, body: bytes) -> Path:
        with self.lock:
            self.count += 1
            out = self.out / f"{self.count:04d}.json"
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("utf-8", "replace")
        kept = {k.lower(): v for k, v in headers.items() if k.lower() not in SECRET_HEADERS}
        out.write_text(json.dumps({"method": method, "path": path, "headers": kept,
                                   "body": parsed, "time": time.time()}, indent=1,
                                  ensure_ascii=False))
        return out

    def forward(self, handler: BaseHTTPRequestHandler, body: bytes, record: Path) -> None:
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=900)
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_HEADERS}
        if body:
            headers["Content-Length"] = str(len(body))
        try:
            conn.request(handler.command, handler.path, body=body or None, headers=headers)
            answer = conn.getresponse()
        except OSError as exc:
            handler.send_error(502, f"upstream: {exc}")
            return
        saved = json.loads(record.read_text())
        saved["status"] = answer.status
        record.write_text(json.dumps(saved, indent=1, ensure_ascii=False))
        handler.send_response(answer.status)
        for k, v in answer.getheaders():
            if k.lower() not in HOP_HEADERS:
                handler.send_header(k, v)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        try:
            while chunk := answer.read1(65536):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()
        handler.close_connection = True


# -- the corpus ---------------------------------------------------------------------------------

def is_model_request(record: dict) -> bool:
    path = record["path"].split("?")[0]
    return record["method"] == "POST" and path.endswith(
        ("/v1/messages", "/v1/responses", "/v1/chat/completions"))


def main_request(records: list[dict]) -> dict | None:
    """The turn's main request: the largest model request (side requests are small)."""
    model = [r for r in records if is_model_request(r)]
    return max(model, key=lambda r: len(json.dumps(r["body"]))) if model else None


def with_tool_result(record: dict, api: str) -> dict:
    """Turn 1's request with a tool call of its first tool and the tool's result appended, in
    the client's own API shape."""
    out = copy.deepcopy(record)
    body = out["body"]
    tools = body.get("tools") or []
    fn = next((t for t in tools if t.get("type") in (None, "function", "custom")
               and (t.get("name") or (t.get("function") or {}).get("name"))), None)
    name = (fn or {}).get("name") or ((fn or {}).get("function") or {}).get("name") or "Bash"
    args = {"command": "ls"}
    if api == "anthropic":
        body["messages"] += [
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_01corpus", "name": name, "input": args}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01corpus",
                 "content": [{"type": "text", "text": "README.md\nsrc\n"}]}]}]
    elif api == "responses":
        body["input"] += [
            {"type": "function_call", "call_id": "call_corpus", "name": name,
             "arguments": json.dumps(args)},
            {"type": "function_call_output", "call_id": "call_corpus",
             "output": "README.md\nsrc\n"}]
    else:
        body["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_corpus", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_corpus", "content": "README.md\nsrc\n"}]
    out["constructed"] = ("built by tools/record_clients.py from turn1.json: a call of the "
                          f"client's tool {name!r} and its result appended in the {api} API's "
                          "shape (not sent by the client)")
    return out


def record_client(name: str, server_url: str, model: str, workdir: Path,
                  timeout_s: float = 900.0) -> tuple[list[list[dict]], list[str]]:
    """Run `name`'s two turns through a recording proxy; the records of each turn and each
    turn's output."""
    client = CLIENTS[name]
    home = workdir / "home"
    work = workdir / "work"
    work.mkdir(parents=True, exist_ok=True)
    turns, outputs = [], []
    for n, prompt in enumerate(PROMPTS, 1):
        recorded = workdir / f"turn{n}"
        with RecordingProxy(server_url, recorded) as proxy:
            env = client.prepare(home, proxy.url, model)
            done = subprocess.run(client.turn(n, prompt), cwd=work, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout_s)
        outputs.append(done.stdout + done.stderr)
        turns.append([json.loads(p.read_text()) for p in sorted(recorded.glob("*.json"))])
    return turns, outputs


def write_corpus(name: str, version: str, turns: list[list[dict]], keep_old: bool) -> Path:
    client = CLIENTS[name]
    out = CORPUS / f"{name}-{version}"
    if not keep_old:
        for old in CORPUS.glob(f"{name}-*"):
            shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    mains = [main_request(records) for records in turns]
    for n, record in enumerate(mains, 1):
        if record is None:
            raise SystemExit(f"{name}: turn {n} sent no model request")
        record.pop("time", None)
        (out / f"turn{n}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    tool = with_tool_result(mains[0], client.api)
    (out / "tool_result.json").write_text(json.dumps(tool, indent=1, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", nargs="+", choices=tuple(CLIENTS), default=tuple(CLIENTS))
    p.add_argument("--keep-old", action="store_true", help="keep older versions' corpus")
    p.add_argument("--upstream", help="a running server instead of starting one")
    p.add_argument("--model", default="local", help="model name the clients ask for")
    p.add_argument("--proxy-only", action="store_true")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.proxy_only:
        with RecordingProxy(args.upstream, args.out, args.port) as proxy:
            print(f"recording {proxy.url} -> {args.upstream} into {args.out}", flush=True)
            threading.Event().wait()
    versions = install(refresh_s=0)
    group = None
    if args.upstream is None:
        from switchyard.testing.group import ServerGroup

        group = ServerGroup("tiny-terse", slots=2, ctx=65536, startup_timeout_s=600,
                            extra=("--served-model-name", args.model)).start()
    try:
        url = args.upstream or group.url
        for name in args.clients:
            with tempfile.TemporaryDirectory(prefix=f"record-{name}-") as tmp:
                start = time.monotonic()
                turns, outputs = record_client(name, url, args.model, Path(tmp))
                out = write_corpus(name, versions[name], turns, args.keep_old)
                print(f"{name} {versions[name]}: {sum(map(len, turns))} requests in "
                      f"{time.monotonic() - start:.0f}s -> {out.relative_to(REPO)}", flush=True)
    finally:
        if group is not None:
            group.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
