"""Helpers shared by the benchmarks in bench/: models, streamed requests, peer server, logs.

Not a benchmark itself. Every figure a benchmark reports is a ratio measured within one run
(the machine is shared and noisy): never an absolute target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

# Model sizes (keyword overrides of fixtures.tiny_models.generate_tiny_model).
MODELS = {
    # The embedded default's shape: hidden 256, 4 layers, 4/2 heads of 64 (4 KiB KV per token).
    "tiny": {},
    # A bigger variant with more realistic prefill costs (8 KiB KV per token).
    "h512": dict(hidden=512, layers=4, heads=4, kv_heads=2, head_dim=128, intermediate=1536),
}


def model_dir(kind: str, path: str | None = None, arch: str = "qwen3") -> Path:
    """`path` if given, else the generated model `kind` of family `arch`, kept under the temp
    dir for reuse."""
    if path:
        return Path(path)
    from fixtures.tiny_models import generate_tiny_model

    name = kind if arch == "qwen3" else f"{kind}-{arch}"
    out = Path(tempfile.gettempdir()) / f"sybench-models-{os.getuid()}" / name
    if not out.exists():
        try:
            generate_tiny_model(out, arch, **MODELS[kind])
        except FileExistsError:
            pass  # another run generated it meanwhile (the write is atomic)
    return out


def load_tokenizer(model: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json"))


def word_list() -> list[str]:
    """Plain words the tiny tokenizer was trained on (about one token each)."""
    from switchyard.twins import tokenizer as tiny_tokenizer

    return sorted(set(tiny_tokenizer._WORDS))


def make_text(rng: random.Random, tokenizer, num_tokens: int, words: list[str]) -> str:
    """Random prose of about `num_tokens` tokens (within a few tokens)."""
    parts: list[str] = []
    count = 0
    while count < num_tokens:
        need = num_tokens - count
        chunk = [rng.choice(words) for _ in range(max(1, need * 3 // 4))]
        sentence = " ".join(chunk)
        n = len(tokenizer.encode(" " + sentence).ids)
        if count + n > num_tokens + 8 and len(chunk) > 4:
            continue
        parts.append(sentence)
        count += n
    return " ".join(parts)


def random_token_ids(rng: random.Random, n: int, lo: int = 300, hi: int = 4000) -> list[int]:
    """Ids of ordinary vocabulary tokens (control and markup tokens sit below `lo`)."""
    return [rng.randrange(lo, hi) for _ in range(n)]


# --- streamed requests ------------------------------------------------------------------------


@dataclass
class Streamed:
    """Timings of one streamed request (perf_counter seconds)."""

    sent: float
    stamps: list[float] = field(default_factory=list)  # one per content-bearing chunk
    finished: float = 0.0
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None
    rid: str | None = None  # the response's "id" (Switchyard logs it as `rid`)

    @property
    def first(self) -> float:
        """Time of the first content chunk, or of the end when none came (stop at once)."""
        return self.stamps[0] if self.stamps else self.finished

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    def decode_tps(self) -> float:
        """Chunks per second from the first to the last content chunk."""
        if len(self.stamps) < 2:
            return float("nan")
        return (len(self.stamps) - 1) / (self.stamps[-1] - self.stamps[0])

    def count_between(self, t0: float, t1: float) -> int:
        return sum(1 for s in self.stamps if t0 <= s <= t1)


def _chunk_has_content(obj: dict) -> bool:
    for choice in obj.get("choices") or []:
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if any(delta.get(k) for k in ("content", "reasoning", "reasoning_content",
                                      "tool_calls")):
            return True
    return False


def stream(url: str, path: str, body: dict, headers: dict | None = None,
           timeout: float = 600.0, client: httpx.Client | None = None,
           on_chunk=None) -> Streamed:
    """POST `body` with stream=True; record when each content chunk arrives.

    `on_chunk()` is called after each content chunk (from the calling thread)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    out = Streamed(sent=time.perf_counter())
    own = client is None
    client = client or httpx.Client(timeout=timeout)
    try:
        with client.stream("POST", url + path, json=body, headers=headers or {}) as resp:
            if resp.status_code != 200:
                resp.read()
                out.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
                out.finished = time.perf_counter()
                return out
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue  # keepalive comments, blank lines
                if line == "data: [DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(line[6:])
                if out.rid is None and obj.get("id"):
                    out.rid = obj["id"]
                if "error" in obj:
                    out.error = str(obj["error"])[:300]
                if _chunk_has_content(obj):
                    out.stamps.append(now)
                    if on_chunk is not None:
                        on_chunk()
                for choice in obj.get("choices") or []:
                    if choice.get("finish_reason"):
                        out.finish_reason = choice["finish_reason"]
                if obj.get("usage"):
                    out.usage = obj["usage"]
    finally:
        if own:
            client.close()
    out.finished = time.perf_counter()
    return out


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s}s")


class MlxLmServer:
    """`python -m mlx_lm server --model DIR --port P` with its default prompt cache settings."""

    def __init__(self, model: Path, extra: list[str] | None = None):
        from switchyard.testing.group import free_port

        self.model = model
        self.port = free_port()
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile(prefix="sybench-mlxlm-", suffix=".log",
                                               delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "MlxLmServer":
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(self.model),
               "--port", str(self.port), *self.extra]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_http(f"{self.url}/health", 120, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # our own child, by its Popen handle
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        try:
            os.unlink(self.log.name)
        except OSError:
            pass


# --- logs -------------------------------------------------------------------------------------


def log_events(path: Path, event: str | None = None) -> list[dict]:
    """JSON log lines of a group log, also when two processes' lines share one line.

    (With PYTHONUNBUFFERED=1, structlog's PrintLogger writes a message and its newline in two
    write() calls, so lines of different processes can end up as `{...}{...}`.)
    """
    decoder = json.JSONDecoder()
    events = []
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return events
    for line in text.splitlines():
        pos = 0
        while pos < len(line) and line[pos] == "{":
            try:
                record, pos = decoder.raw_decode(line, pos)
            except ValueError:
                break
            if event is None or record.get("event") == event:
                events.append(record)
    return events


def timestamp(record: dict) -> float:
    """A log record's ISO timestamp as epoch seconds."""
    from datetime import datetime

    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


# --- figures ----------------------------------------------------------------------------------


def median(xs) -> float:
    xs = [x for x in xs if x == x]  # drop NaN
    return statistics.median(xs) if xs else float("nan")


def fmt(x: float, digits: int = 3) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_with_model(ap: argparse.ArgumentParser, seed: int = 12):
    """Add --seed, --model-size and --model (the last options), parse, warn on stderr when
    OpenBLAS is not preloaded; return the arguments and the model directory."""
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--model-size", default="tiny")
    ap.add_argument("--model")
    args = ap.parse_args()
    if note := preload_note():
        print(note, file=sys.stderr)
    return args, model_dir(args.model_size, args.model)


def preload_note() -> str:
    return "" if "openblas" in os.environ.get("LD_PRELOAD", "") else (
        "warning: LD_PRELOAD has no OpenBLAS; MLX's reference BLAS makes everything slow")
