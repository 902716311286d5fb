"""Peers for the benchmarks on a real model: a GGUF exported as a Hugging Face directory,
vllm-mlx in a venv of its own, and the memory of a server's whole process tree.

Not a benchmark itself (bench/agent_traffic.py uses it). Everything it builds is cached per
machine under Switchyard's cache directory, `<cache>/bench/`:

- `hf/<name>`: the GGUF's weights and tokenizer as a directory mlx-lm (and so mlx_lm.server and
  vllm-mlx) loads as is. `same` keeps the weights exactly as Switchyard's GGUF loader holds them
  (MLX affine 4/8-bit groups of 32, the same kernels and numerics); `f16` / `f32` dequantize
  them. llama.cpp's q/k row permutation is undone by the loader (worker/gguf_loading.py).
- `vllm-mlx-venv`: `pip install --no-deps vllm-mlx==0.6.0`, then the dependencies text serving
  needs (VLLM_MLX_DEPS, mlx-lm 0.31.3 as vllm-mlx requires), never into the project's venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._common import wait_http

VLLM_MLX = "vllm-mlx==0.6.0"
VLLM_MLX_DEPS = ["mlx[cpu]" if sys.platform.startswith("linux") else "mlx", "mlx-lm==0.31.3",
                 "transformers>=5,<6", "tokenizers", "fastapi", "starlette", "uvicorn",
                 "pydantic", "numpy", "pyyaml", "psutil", "prometheus-client", "jsonschema",
                 "requests", "tqdm", "python-multipart"]
PEER_WEIGHTS = ("same", "f16", "f32")


def bench_cache() -> Path:
    from switchyard.common.settings import user_cache_dir

    return user_cache_dir() / "bench"


# --- a GGUF as a Hugging Face directory ---------------------------------------------------------


def hf_export(gguf: Path, weights: str = "same") -> Path:
    """The directory for `gguf` with `weights` (PEER_WEIGHTS), built once per machine."""
    st = gguf.stat()
    out = bench_cache() / "hf" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}-{weights}"
    if (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=out.parent))
    try:
        _write_hf(gguf, weights, tmp)
        try:
            tmp.rename(out)
        except OSError:  # another run exported it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_hf(gguf: Path, weights: str, out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from switchyard.common.tokenizer_loading import save_gguf_tokenizer
    from switchyard.worker.gguf_loading import load_gguf

    if weights not in PEER_WEIGHTS:
        raise ValueError(f"weights: one of {', '.join(PEER_WEIGHTS)}")
    model, config = load_gguf(gguf)
    params = dict(tree_flatten(model.parameters()))
    quant = config.pop("quantization", None)
    if weights == "same":
        if quant:
            config["quantization"] = quant
    else:
        dtype = mx.float16 if weights == "f16" else mx.float32
        params = _dequantized(params, quant or {}, dtype)
    config["architectures"] = [_hf_architecture(config["model_type"])]
    mx.save_safetensors(str(out / "model.safetensors"), params, metadata={"format": "mlx"})
    eos = save_gguf_tokenizer(gguf, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def _dequantized(params: dict, quant: dict, dtype) -> dict:
    import mlx.core as mx

    out = {}
    for name, value in params.items():
        module, leaf = name.rsplit(".", 1)
        q = quant.get(module) if isinstance(quant.get(module), dict) else None
        if q is None and f"{module}.scales" in params:
            q = {k: quant[k] for k in ("group_size", "bits", "mode") if k in quant}
        if q is None:
            out[name] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
        elif leaf == "weight":
            out[name] = mx.dequantize(value, params[f"{module}.scales"],
                                      params.get(f"{module}.biases"), group_size=q["group_size"],
                                      bits=q["bits"], mode=q.get("mode", "affine")).astype(dtype)
        # a quantized module's scales and biases are folded into its weight
    return out


def _hf_architecture(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}.get(model_type, model_type)


# --- vllm-mlx -----------------------------------------------------------------------------------


def vllm_mlx_venv(log=print) -> Path:
    """The venv's `vllm-mlx` executable, installing it on first use."""
    venv = bench_cache() / "vllm-mlx-venv"
    exe = venv / "bin" / "vllm-mlx"
    if exe.exists():
        return exe
    log(f"installing {VLLM_MLX} into {venv} (once per machine)")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--no-deps", VLLM_MLX], check=True)
    subprocess.run([*pip, *VLLM_MLX_DEPS], check=True)
    return exe


class PeerServer:
    """A peer's server in a session of its own (its process group is the server's whole tree),
    held on the test lifeline so it dies with this process however it dies; log kept in a
    temp dir until exit."""

    name = "peer"

    def __init__(self, cmd: list[str], env: dict | None = None, startup_s: float = 300):
        from switchyard.testing.group import free_port, short_tmp_dir

        self.port = free_port()
        self.dir = short_tmp_dir("sypeer")
        self.log_path = self.dir / "server.log"
        self.cmd = [c.replace("{port}", str(self.port)).replace("{dir}", str(self.dir))
                    for c in cmd]
        self.env = dict(os.environ) | (env or {})
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pgid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self):
        from switchyard.testing.lifeline import lifeline

        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        lifeline().hold(self.proc.pid, self.dir, 20.0, [self.dir])
        try:
            wait_http(f"{self.url}/health", self.startup_s, self.proc)
        except BaseException:
            print(self.log_text()[-3000:], file=sys.stderr)
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from switchyard.testing.lifeline import lifeline

        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # our own session: the server and its children
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, 9)  # anything left in the group
        except ProcessLookupError:
            pass
        lifeline().release(self.proc.pid)
        self.proc = None

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def mlx_lm_server(model: Path, extra: list[str] = ()) -> PeerServer:
    """`python -m mlx_lm server` of this venv, its default prompt-cache settings."""
    server = PeerServer([sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                         "--port", "{port}", *extra])
    server.name = "mlx_lm.server"
    return server


def vllm_mlx_server(model: Path, ssd_gb: float, extra: list[str] = ()) -> PeerServer:
    """`vllm-mlx serve` with continuous batching, its prefix cache and SSD tier; HOME is the
    run's own dir (it saves its RAM cache under ~/.cache/vllm-mlx at shutdown and loads it at
    start)."""
    exe = vllm_mlx_venv()
    server = PeerServer([str(exe), "serve", str(model), "--host", "127.0.0.1", "--port", "{port}",
                         "--continuous-batching", "--enable-prefix-cache",
                         "--ssd-cache-dir", "{dir}/ssd", "--ssd-cache-max-gb", f"{ssd_gb:g}",
                         *extra])
    server.env |= {"HOME": str(server.dir / "home"), "HF_HUB_OFFLINE": "1",
                   "PYTHONUNBUFFERED": "1"}
    server.name = "vllm-mlx"
    return server


def vllm_cached_tokens(log: str) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per request from vllm-mlx's log, in scheduling order: a
    `[cache_fetch] ... HIT/MISS` line, raised by a later `[ssd_promote] ... M/P tokens from SSD`
    of the same request."""
    import re

    order: list[str] = []
    seen: dict[str, list[int]] = {}
    fetch = re.compile(r"\[cache_fetch\] request=(\S+) (HIT|MISS) prompt_tokens=(\d+)"
                       r"(?: cached=(\d+))?")
    promote = re.compile(r"\[ssd_promote\] request=(\S+) .*?promote: (\d+)/(\d+) tokens")
    for line in log.splitlines():
        if m := fetch.search(line):
            rid = m.group(1)
            if rid not in seen:
                order.append(rid)
            seen[rid] = [int(m.group(3)), int(m.group(4) or 0)]
        elif (m := promote.search(line)) and m.group(1) in seen:
            seen[m.group(1)][1] = max(seen[m.group(1)][1], int(m.group(2)))
    return [tuple(seen[rid]) for rid in order]


# --- memory of a process tree --------------------------------------------------------------------


def _group_pids(pgid: int) -> list[int]:
    from switchyard.testing.group import group_members

    return group_members(pgid)


def _kib(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


class TreeMemory:
    """Samples the summed RSS and PSS of every process in a process group (Linux /proc) until
    stopped; PSS counts a shared page (the kvstore's shared memory, mapped files) once in all.
    `peak_rss` / `peak_pss` in bytes."""

    def __init__(self, pgid: int, interval_s: float = 0.5):
        self.pgid = pgid
        self.interval_s = interval_s
        self.peak_rss = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        rss = pss = 0
        for pid in _group_pids(self.pgid):
            rss += _kib(f"/proc/{pid}/status", "VmRSS:")
            pss += _kib(f"/proc/{pid}/smaps_rollup", "Pss:")
        self.peak_rss = max(self.peak_rss, rss * 1024)
        self.peak_pss = max(self.peak_pss, pss * 1024)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)
        self.sample()


def wait_until(pred, timeout_s: float, step_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step_s)
    return pred()
