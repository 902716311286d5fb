"""The settings schema every process shares: defaults < TOML file (`--config`) < CLI flags.

One dataclass, one argparse parser built from it. The supervisor passes the resolved settings to
its children as explicit flags (`Settings.to_args`), so `switchyard run worker ...` under launchd
and a child of `switchyard serve` see exactly the same values.

The API key never goes on a command line (any local user reads those with `ps`): it is read
from `--api-key-file` (mode 0600, as llama.cpp's `--api-key-file` and systemd's
`LoadCredential=`) or from `$SWITCHYARD_API_KEY` (as vLLM's `VLLM_API_KEY`), and only the
gateway is given it (docs/design/security.md "Security").
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from switchyard.common.group_key import read_group_key
from switchyard.common.hostfile import BACKENDS, PARALLEL_MODES
from switchyard.common.secret_keys import load_peer_key
from switchyard.common.script import ScriptError, load_script
from switchyard.common.secret_files import SettingsError, read_private_file
from switchyard.common.tenants import KeyFileError, Tenants, resolved_keys

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """'64GiB' -> bytes. Accepts plain integers and SI or binary units."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 500MB, 64GiB, 1TB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def user_cache_dir() -> Path:
    """Switchyard's cache directory: ~/Library/Caches on macOS, XDG elsewhere."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "switchyard"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard"


def _user_runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "switchyard"
    # macOS has no XDG runtime dir; $TMPDIR is per-user there. ipc paths must stay short.
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"switchyard-{os.getuid()}"


# --max-running 0 runs at most this many requests at once (Settings.auto_running).
MAX_AUTO_RUNNING = 32
# Speculative decoding's proposers (docs/design/speculative-decoding.md "Speculative decoding").
SPECULATIVE_MODES = ("auto", "suffix", "draft", "mtp", "off")

# The model families' output formats (gateway/output/formats.py has their syntax).
CHAT_FORMATS = ("auto", "hermes", "qwen3_coder", "harmony", "glm", "deepseek_v31", "minimax_m2",
                "mistral", "mistral_args", "llama3_json", "gemma3", "gemma4")


def draft_model_problems(settings: "Settings") -> list[str]:
    """--draft-model and --speculative together (docs/design/speculative-decoding.md "Speculative decoding")."""
    if settings.speculative == "draft" and not settings.draft_model:
        return ["--speculative draft needs --draft-model PATH (a smaller model with the same "
                "tokenizer)"]
    if not settings.draft_model:
        return []
    if settings.speculative in ("suffix", "mtp", "off"):
        return [f"--draft-model is unused with --speculative {settings.speculative}; use "
                "--speculative auto or draft, or drop --draft-model"]
    if settings.hostfile:
        return ["--draft-model runs on a single worker; serve it without --hostfile"]
    return []


def _opt(help: str, **kw):
    return field(metadata={"help": help}, **kw)


@dataclass(frozen=True)
class Settings:
    model: str = _opt("MLX/HF model directory, Hugging Face repo id or .gguf file; `tiny`: a "
                      "generated random-weight model, `tiny-terse` one that ends its replies (default: "
                      "SmolLM2-135M-Instruct, fetched "
                      "once into the cache dir)", default="")
    served_model_name: tuple[str, ...] = _opt(
        "model names clients may use (repeatable; the first is the one replies carry; default: "
        "the model directory's or file's name)", default=())
    background_model: tuple[str, ...] = _opt(
        "model names whose requests run at background priority unless they ask otherwise "
        "(repeatable; served as aliases of the model): point an agent's sub-agents at one, "
        "e.g. Claude Code's CLAUDE_CODE_SUBAGENT_MODEL", default=())
    host: str = _opt("address the HTTP gateway binds", default="127.0.0.1")
    port: int = _opt("HTTP port", default=8000)
    slots: int = _opt("conversations whose KV stays in memory between turns (how many run "
                      "and decode in one batch at once: --max-running)", default=4)
    max_running: int = _opt("requests run at once, each holding its KV in memory while it runs; "
                            "past --slots, an idle conversation's KV leaves memory and its "
                            "pages stay on disk; when the KV they hold outgrows memory, the "
                            "newest is staged to disk and resumes later (0: as many as the "
                            "memory plan holds at 8K tokens each, up to 32; --slots with a "
                            "draft model, MTP, a worker group or caches that cannot be "
                            "batched)",
                            default=0)
    release_after_s: float = _opt("with --max-running past --slots: seconds an idle "
                                  "conversation's KV stays in memory before it leaves (a tool "
                                  "call's result comes back within seconds)", default=10.0)
    ctx: int = _opt("context length of every slot, in tokens", default=32768)
    kv_dir: str = _opt("directory of KV page files", default="")
    runtime_dir: str = _opt("directory for sockets and pid files (created 0700)", default="")
    scheduler_address: str = _opt(
        "worker group over several machines: tcp://IP:PORT the scheduler also binds for the "
        "other hosts' kvstores, and they connect to (one IP, e.g. the Thunderbolt bridge's; "
        "never a wildcard); needs --group-key-file", default="")
    group_key_file: str = _opt(
        "worker group over several machines: the key file (`switchyard group-key --out PATH`, "
        "mode 0600, copied to every host) that authenticates --scheduler-address",
        default="")
    cache_dir: str = _opt("directory for the default models, KV pages (unless --kv-dir) "
                          "and other caches", default="")
    page_size: int = _opt("tokens per KV page", default=256)
    kv_disk_budget: str = _opt("disk budget for KV pages, with units", default="32GiB")
    kv_write_back: bool = _opt("with a disk budget smaller than the KV memory, write a "
                               "conversation's pages as it leaves memory rather than as they "
                               "fill: the disk holds what memory does not, but a crash of the "
                               "worker loses what only memory held (one asked to stop writes it "
                               "first; attention-only models)", default=False)
    kv_buffer_memory: str = _opt("shared memory for page buffers between worker and kvstore",
                                 default="256MiB")
    kv_bits: int = _opt("quantize attention KV in slots and pages to 8 or 4 bits (0: the "
                        "model's dtype); pages of another setting are never matched", default=0)
    kv_group_size: int = _opt("elements per quantization scale and bias with --kv-bits "
                              "(32, 64 or 128; must divide the head dimension; 0: 32 with "
                              "4 bits, 64 with 8, or what divides it)", default=0)
    state_interval: int = _opt("hybrid models: tokens between recurrent-state snapshots of a "
                               "long prefill", default=4096)
    kv_protect_hours: float = _opt("pages of conversations active this recently are evicted "
                                   "last", default=24.0)
    prefill_chunk: int = _opt("most prompt tokens prefilled in one step (shared by all "
                              "prefilling sequences)", default=512)
    packed_prefill: bool = _opt("run the prefill chunks of several conversations that wait "
                                "in the same step as one forward pass, the weights read once "
                                "for all (text models without sliding-window layers)",
                                default=True)
    decode_burst: int = _opt("decode iterations the worker may run per step when nothing "
                             "else waits (fewer round trips; new work waits at most this "
                             "many tokens)", default=8)
    speculative: str = _opt("speculative decoding: auto (drafts copied from the "
                            "conversations' own text, and with --draft-model the draft "
                            "model's where no copy matches, as long as they pay on this "
                            "machine), suffix (every copied draft whole, whatever a verify "
                            "pass costs; refused where the model cannot verify), draft (every "
                            "decoding sequence drafted by --draft-model, whatever it costs), "
                            "mtp (drafts from the multi-token-prediction head the checkpoint "
                            "ships, Qwen3.5's mtp.* tensors; refused where it ships none) "
                            "or off", default="auto")
    draft_model: str = _opt("a smaller model with the same tokenizer (any format --model "
                            "takes) that drafts tokens in the worker for speculative decoding "
                            "(--speculative auto or draft)", default="")
    num_draft_tokens: int = _opt("most tokens proposed for one sequence in one step "
                                 "(speculative decoding's upper bound)", default=8)
    decode_share: float = _opt("while a request prefills, decoding streams keep this share of "
                               "their solo speed; beside more requests waiting for a first "
                               "token, their fair part (at least 0.1); 0 disables the limit",
                               default=0.5)
    overtake_limit: float = _opt("shorter newcomers may prefill ahead of a waiting request "
                                 "until others got this many times its remaining prompt "
                                 "tokens (0: first come, first served)", default=1.0)
    slice_tokens: int = _opt("time slicing: tokens a request generates in its slot before "
                             "it gives the slot to a request waiting for its first token "
                             "(doubled each time it gives one up; 0: never)", default=0)
    background_wait: float = _opt("seconds a background request waits before it is "
                                  "scheduled as interactive (0: no bound)", default=30.0)
    max_queue: int = _opt("waiting requests before new ones get 429", default=64)
    max_body_bytes: int = _opt("largest accepted HTTP body", default=32 * 2**20)
    max_connections: int = _opt("HTTP connections and requests served at once; beyond, 503",
                                default=256)
    read_timeout_s: float = _opt("seconds a client has to send a request's headers, and "
                                 "again its body; slower connections are closed (408)",
                                 default=30.0)
    default_max_tokens: int = _opt("max_tokens when a request gives none", default=2048)
    # Images (vision-language models; docs/design/images.md "Images").
    max_images: int = _opt("most images in one request (a vision-language model)", default=16)
    max_image_pixels: int = _opt("most pixels (width x height) of one image; larger ones are "
                                 "refused before they are decoded", default=4096 * 4096)
    image_fetch: bool = _opt("fetch http(s) image URLs (off: only data: URLs); never from "
                             "loopback, private or link-local addresses", default=False)
    image_fetch_bytes: str = _opt("largest image file fetched from a URL", default="20MiB")
    image_fetch_timeout_s: float = _opt("seconds to fetch one image URL", default=10.0)
    vision_cache: str = _opt("worker memory for the vision encoder's output, kept per "
                             "distinct image", default="512MiB")
    prefix_stable: bool = _opt("render remembered assistant turns with the exact tokens the "
                               "model generated, so resent histories reuse their KV",
                               default=True)
    keep_reasoning: bool = _opt("keep earlier <think> blocks in the rendered history",
                                default=True)
    chat_format: str = _opt("tool-call and reasoning format: " + ", ".join(CHAT_FORMATS)
                            + " (auto: from the model's chat template)", default="auto")
    script: str = _opt("scripted replies: a JSON file of rules that decide the model's words "
                       "(docs/clients.md \"Scripted replies\"); for trying clients and tests",
                       default="")
    history_turns: int = _opt("assistant turns remembered for prefix-stable rendering",
                              default=1024)
    max_stored_responses: int = _opt("Responses API conversations kept for "
                                     "previous_response_id", default=256)
    api_key: str = _opt("require this key (Bearer / x-api-key); needed off loopback. Visible "
                        "in `ps`: prefer --api-key-file or $SWITCHYARD_API_KEY", default="")
    api_key_file: str = _opt("read the API keys from this file (mode 0600): one tenant a line, "
                             "'NAME KEY' or 'KEY'; '#' comments", default="")
    shared_prefix_tenants: tuple[str, ...] = _opt(
        "tenants (key names) whose requests share one cache salt: their prefix pages, drafts "
        "and remembered turns are common (a system prompt prefilled once for all of them)",
        default=())
    allowed_hosts: str = _opt("comma-separated extra Host names the gateway answers besides "
                              "loopback names and --host ('*': any)", default="")
    allowed_origins: str = _opt("comma-separated browser origins allowed to call the API "
                                "(scheme://host[:port]; '*': any)", default="")
    log_level: str = _opt("debug, info, warning or error", default="info")
    log_format: str = _opt("json, console or auto (console on a TTY)", default="auto")
    log_content: bool = _opt("allow prompt and output text in logs", default=False)
    heartbeat_s: float = _opt("seconds between heartbeats", default=1.0)
    peer_timeout_s: float = _opt("a peer silent this long is considered gone", default=5.0)
    peer: tuple[str, ...] = _opt(
        "another Switchyard server's base URL (repeatable): a prefix neither in memory nor on "
        "disk here is asked of the peers before it is prefilled, and this server serves its "
        "pages to theirs (docs/operations.md \"Pages from a peer\")", default=())
    peer_key_file: str = _opt("the key (32 bytes, mode 0600) peers authenticate each other "
                              "and their pages with; the same file on every peer (default: "
                              "<cache dir>/peer.key, made once)", default="")
    peer_fetch_timeout_s: float = _opt("the most a request waits for its pages from the peers "
                                       "before it prefills them itself", default=2.0)
    memory_headroom: str = _opt("memory kept free beyond the plan", default="1GiB")
    kv_memory: str = _opt("the most memory the KV of running requests and resident "
                          "conversations may take (e.g. 8GiB; empty: what the device limit "
                          "leaves after weights, activations, buffers and --memory-headroom)",
                          default="")
    hostfile: str = _opt("run the worker as a group of ranks over these hosts (mlx.launch's "
                         "hostfile JSON; one rank per entry; absent: one worker)", default="")
    backend: str = _opt("mx.distributed backend of a worker group: ring, jaccl or mpi "
                        "(default: the hostfile's \"backend\", else ring)", default="")
    parallel: str = _opt("how a worker group splits the model: tensor (every layer's heads "
                         "and experts) or pipeline (whole layers per rank)", default="tensor")
    dist_port: int = _opt("first TCP port of the ring backend (one per rank and ip)",
                          default=5520)
    group_timeout_s: float = _opt("a worker group's rank exits (and its machine's ranks restart) "
                                  "when one step, idle ping or broadcast has waited this long "
                                  "for the other ranks: a peer that vanished without closing "
                                  "its connection", default=120.0)
    rank: int = _opt("this process's rank in the worker group (set by the supervisor or a "
                     "host's unit on `run worker` and `run kvstore`)", default=0)

    @property
    def kv_disk_budget_bytes(self) -> int:
        return parse_size(self.kv_disk_budget)

    @property
    def runtime_path(self) -> Path:
        return Path(self.runtime_dir) if self.runtime_dir else _user_runtime_dir()

    @property
    def kv_path(self) -> Path:
        return Path(self.kv_dir) if self.kv_dir else self.cache_path / "kv"

    @property
    def rank_kv_path(self) -> Path:
        """This rank's page directory: --kv-dir for rank 0, `<kv-dir>/rank-R` for rank R of a
        worker group, on every host (docs/design/worker-groups.md "Pages per rank")."""
        return self.kv_path / f"rank-{self.rank}" if self.rank else self.kv_path

    @property
    def worker_slots(self) -> int:
        """Slots the worker holds: one per running request (--max-running), at least --slots;
        the scheduler keeps at most --slots of them resident while idle (docs/design/scheduling.md
        "Running past the resident slots"). With --max-running 0 the worker decides
        (`auto_running`) and tells the scheduler; until then this is --slots."""
        return max(self.slots, self.max_running)

    @property
    def auto_running(self) -> int:
        """The most requests --max-running 0 runs at once, if the memory plan holds them: a
        decode batch of 32 rows costs about what one of 4 does (it reads the weights), and
        agent traffic fans out 20 sub-agents."""
        return max(self.slots, MAX_AUTO_RUNNING)

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else user_cache_dir()

    def validate(self) -> "Settings":
        problems = []
        if self.slots < 1:
            problems.append("--slots must be at least 1")
        if self.max_running < 0 or self.release_after_s < 0:
            problems.append("--max-running and --release-after-s must not be negative")
        if self.ctx < 2 * self.page_size:
            problems.append("--ctx must hold at least two pages")
        if self.page_size < 16:
            problems.append("--page-size must be at least 16")
        if self.prefill_chunk < 1:
            problems.append("--prefill-chunk must be at least 1")
        if self.kv_bits not in (0, 4, 8):
            problems.append("--kv-bits must be 8 or 4 (0 keeps the model's dtype)")
        if self.kv_group_size not in (0, 32, 64, 128):
            problems.append("--kv-group-size must be 32, 64 or 128 (0: chosen for --kv-bits)")
        if self.decode_burst < 1:
            problems.append("--decode-burst must be at least 1")
        if self.speculative not in SPECULATIVE_MODES:
            problems.append(f"--speculative must be one of {', '.join(SPECULATIVE_MODES)}")
        problems.extend(draft_model_problems(self))
        if not 1 <= self.num_draft_tokens <= 64:
            problems.append("--num-draft-tokens must be 1..64")
        if self.slice_tokens < 0:
            problems.append("--slice-tokens must not be negative")
        if self.overtake_limit < 0 or self.background_wait < 0:
            problems.append("--overtake-limit and --background-wait must not be negative")
        if not 0 <= self.decode_share < 1:
            problems.append("--decode-share must be in [0, 1)")
        if self.max_connections < 1 or self.read_timeout_s <= 0:
            problems.append("--max-connections and --read-timeout-s must be positive")
        if not 0 < self.port < 65536:
            problems.append("--port must be 1..65535")
        if self.chat_format not in CHAT_FORMATS:
            problems.append(f"--chat-format must be one of {', '.join(CHAT_FORMATS)}")
        if self.log_format not in ("json", "console", "auto"):
            problems.append("--log-format must be json, console or auto")
        if self.max_images < 0 or self.max_image_pixels < 1 or self.image_fetch_timeout_s <= 0:
            problems.append("--max-images must not be negative, --max-image-pixels and "
                            "--image-fetch-timeout-s must be positive")
        try:
            parse_size(self.kv_disk_budget)
            parse_size(self.memory_headroom)
            if self.kv_memory:
                parse_size(self.kv_memory)
            parse_size(self.kv_buffer_memory)
            parse_size(self.image_fetch_bytes)
            parse_size(self.vision_cache)
        except ValueError as exc:
            problems.append(str(exc))
        if self.backend not in ("", *BACKENDS):
            problems.append(f"--backend must be one of {', '.join(BACKENDS)}")
        if self.parallel not in PARALLEL_MODES:
            problems.append(f"--parallel must be one of {', '.join(PARALLEL_MODES)}")
        if not 0 < self.dist_port < 65536 or self.rank < 0:
            problems.append("--dist-port must be 1..65535 and --rank at least 0")
        if self.group_timeout_s <= 0:
            problems.append("--group-timeout-s must be positive")
        if self.scheduler_address and not _bindable_tcp(self.scheduler_address):
            problems.append("--scheduler-address must be tcp://IP:PORT with one IP address "
                            "(not a wildcard or a name), e.g. tcp://10.0.0.1:5510")
        if self.scheduler_address and not self.group_key_file:
            problems.append("--scheduler-address needs --group-key-file: make one with "
                            "`switchyard group-key --out PATH` and copy it (mode 0600) to "
                            "every host of the group")
        if self.host not in LOOPBACK_HOSTS and not (self.api_key or self.api_key_file):
            problems.append(f"--api-key is required when binding to {self.host} (not loopback)")
        if self.shared_prefix_tenants and self.api_key:  # where the keys are known (the gateway)
            try:
                Tenants.from_settings(self.api_key, self.shared_prefix_tenants)
            except KeyFileError as exc:
                problems.append(str(exc))
        problems.extend(peer_problems(self))
        if any(not name.strip() for name in self.served_model_name):
            problems.append("--served-model-name must not be empty")
        if any(not name.strip() for name in self.background_model):
            problems.append("--background-model must not be empty")
        if self.script:
            try:
                load_script(self.script)
            except ScriptError as exc:
                problems.append(str(exc))
        if problems:
            raise SettingsError("; ".join(problems))
        return self

    def to_args(self, role: str = "gateway") -> list[str]:
        """Flags that reproduce these settings for a child of `role`: never the API key (the
        supervisor hands it to the gateway alone, by environment or file), and the HTTP
        address only to the gateway, the one process that binds it."""
        return [a for f in dataclasses.fields(self)
                if f.name not in SECRET_FIELDS and (role == "gateway" or f.name not in GATEWAY_ONLY)
                for a in flag_args(f.name, getattr(self, f.name))]


def peer_problems(settings: "Settings") -> list[str]:
    """--peer URLs and the fetch deadline (docs/design/kv-pages.md "Pages from a peer")."""
    bad = [url for url in settings.peer
           if not re.fullmatch(r"https?://[^/\s?#]+/?", url.strip())]
    problems = [f"--peer must be a server's base URL (http://HOST:PORT), not {url!r}"
                for url in bad]
    if settings.peer and settings.hostfile:
        problems.append("--peer serves and fetches a single worker's pages; serve without "
                        "--hostfile")
    if not 0 < settings.peer_fetch_timeout_s <= 60:
        problems.append("--peer-fetch-timeout-s must be in (0, 60]")
    return problems


def _bindable_tcp(address: str) -> bool:
    """tcp://IP:PORT with a literal, non-wildcard IP: the scheduler's TCP endpoint is bound
    to one interface only (docs/design/worker-groups.md "Pages per rank")."""
    if not address.startswith("tcp://"):
        return False
    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return port.isdigit() and 0 < int(port) < 65536 and not ip.is_unspecified


def flag_args(name: str, value) -> list[str]:
    """The command-line flags that set setting `name` to `value`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else f"--no-{flag[2:]}"]
    if isinstance(value, tuple):  # repeatable
        return [a for item in value for a in (flag, str(item))]
    return [flag, str(value)]


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
API_KEY_ENV = "SWITCHYARD_API_KEY"
SECRET_FIELDS = ("api_key", "api_key_file")
GATEWAY_ONLY = ("host", "port", "allowed_hosts", "allowed_origins", "shared_prefix_tenants",
                "script")


_KEY_FILE_BYTES = 64 * 1024


def read_api_key_file(path: str) -> str:
    """The keys in `path` (common/tenants.py: one a line, 'NAME KEY' or 'KEY'), refusing a file
    other users can read: a file of one key alone gives that key, as it always did."""
    data = read_private_file(path, "--api-key-file", _KEY_FILE_BYTES + 1)
    if len(data) > _KEY_FILE_BYTES:  # the keys travel to the gateway in its environment
        raise SettingsError(f"--api-key-file {path} is larger than {_KEY_FILE_BYTES} bytes")
    text = data.decode("utf-8", "replace")
    try:
        keys = resolved_keys(text, f"--api-key-file {path}")
    except KeyFileError as exc:
        raise SettingsError(str(exc)) from None
    if not keys:
        raise SettingsError(f"--api-key-file {path} is empty")
    return keys


def resolve_api_key(values: dict, env: dict | None = None) -> dict:
    """--api-key, else --api-key-file, else $SWITCHYARD_API_KEY, into `values["api_key"]`."""
    env = os.environ if env is None else env
    if values.get("api_key"):
        return values
    if values.get("api_key_file"):
        return {**values, "api_key": read_api_key_file(values["api_key_file"])}
    if env.get(API_KEY_ENV):
        return {**values, "api_key": env[API_KEY_ENV].strip()}
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with settings (flags override it)")
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=f.metadata["help"])
        elif str(f.type).startswith("tuple"):  # `--x a b` and `--x a --x b`, as vLLM takes them
            parser.add_argument(flag, dest=f.name, action="extend", nargs="+", default=None,
                                metavar="NAME", help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, dest=f.name, type=kind, default=None,
                                help=f"{f.metadata['help']} (default: {f.default})")


def from_namespace(ns: argparse.Namespace) -> Settings:
    values: dict = {}
    if getattr(ns, "config", None):
        values.update(load_toml(Path(ns.config)))
    for f in dataclasses.fields(Settings):
        given = getattr(ns, f.name, None)
        if given is not None:
            values[f.name] = given
    for f in dataclasses.fields(Settings):  # lists (flags, TOML arrays or a TOML string)
        if str(f.type).startswith("tuple") and f.name in values:
            given = values[f.name]
            values[f.name] = (given,) if isinstance(given, str) else tuple(given)
    settings = Settings(**resolve_api_key(values)).validate()
    if settings.group_key_file:  # refuse a bad or readable key file before starting anything
        read_group_key(settings.group_key_file)
    if settings.peer and settings.peer_key_file:
        load_peer_key(settings.peer_key_file, settings.cache_path)
    return settings


def load_toml(path: Path) -> dict:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SettingsError(f"cannot read config {path}: {exc}") from None
    known = {f.name: f for f in dataclasses.fields(Settings)}
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise SettingsError(f"{path}: unknown setting {key!r}")
        values[name] = value
    return values
