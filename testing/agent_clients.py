"""Real agent clients, installed as their users install them and run headless against a server.

    versions = install()                       # npm, into <cache dir>/agent-clients; or raise
    client = CLIENTS["codex"]
    env = client.prepare(home, "http://127.0.0.1:8000", "local")   # scratch HOME, config files
    subprocess.run(client.turn(1, "Say hello."), env=env, cwd=work, ...)

The clients are npm packages, installed with `npm install PKG@latest ...` into a per-machine
cache directory (`~/.cache/switchyard/agent-clients/`, never the repository) at the versions npm
gives on the day: an install older than a day is refreshed. Their configuration (environment
variables, config files) is built here from the server's URL and the model name, and the
section per client of docs/clients.md shows exactly what `doc_blocks(name)` renders for
`http://127.0.0.1:8000` and the model name `local` (tests/unit/test_client_corpus.py checks it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from switchyard.common.settings import user_cache_dir

DOC_URL = "http://127.0.0.1:8000"  # what docs/clients.md's blocks show
DOC_MODEL = "local"                 # docs/clients.md serves with --served-model-name local
REFRESH_S = 24 * 3600                  # an install older than this is refreshed (npm @latest)


class ClientsUnavailable(Exception):
    """The clients could not be installed here (no npm, no registry); the message says why."""


def clients_dir() -> Path:
    return Path(os.environ.get("SWITCHYARD_AGENT_CLIENTS") or user_cache_dir() / "agent-clients")


# -- each client's configuration, as docs/clients.md shows it ------------------------------------

def claude_code_env(url: str, model: str) -> dict[str, str]:
    """Claude Code (Anthropic Messages API): every model slot it uses names the served model."""
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": "none",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def codex_config(url: str, model: str) -> str:
    """Codex CLI (Responses API): ~/.codex/config.toml."""
    return (f'model = "{model}"\n'
            'model_provider = "switchyard"\n'
            '\n'
            '[model_providers.switchyard]\n'
            'name = "Switchyard"\n'
            f'base_url = "{url}/v1"\n'
            'wire_api = "responses"\n'
            'env_key = "SWITCHYARD_API_KEY"\n')


def qwen_code_env(url: str, model: str) -> dict[str, str]:
    """Qwen Code (OpenAI Chat Completions)."""
    return {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "none", "OPENAI_MODEL": model}


def qwen_code_settings() -> str:
    """~/.qwen/settings.json: the OpenAI-compatible API, without asking which at start."""
    return json.dumps({"security": {"auth": {"selectedType": "openai"}}}, indent=2) + "\n"


def opencode_config(url: str, model: str) -> str:
    """opencode (OpenAI Chat Completions through @ai-sdk/openai-compatible):
    ~/.config/opencode/opencode.json."""
    return json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "switchyard": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Switchyard",
                "options": {"baseURL": f"{url}/v1", "apiKey": "none"},
                "models": {model: {"name": model}},
            },
        },
        "model": f"switchyard/{model}",
        "autoupdate": False,
        "share": "disabled",
    }, indent=2) + "\n"


def _exports(env: dict[str, str]) -> str:
    return "".join(f"export {k}={v}\n" for k, v in env.items())


# -- the catalog ------------------------------------------------------------------------------

# Quiet for a scratch HOME in a test: no telemetry, no update checks (not user configuration).
_QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
          "CI": "1", "NO_COLOR": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
          "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"}


@dataclass(frozen=True)
class Client:
    name: str      # also the corpus directory's prefix: tests/corpus/<name>-<version>/
    package: str   # the npm package
    bin: str       # its command in node_modules/.bin
    api: str       # "anthropic", "responses" or "chat"

    @property
    def path(self) -> Path:
        return clients_dir() / "node_modules" / ".bin" / self.bin

    def prepare(self, home: Path, url: str, model: str) -> dict[str, str]:
        """Write the client's config under the scratch `home` and return the environment to run
        it with (PATH kept, HOME replaced, nothing else inherited)."""
        home.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
               "LANG": "C.UTF-8", "TERM": "dumb", **_QUIET}
        if self.name == "claude-code":
            env |= claude_code_env(url, model)
        elif self.name == "codex":
            (home / ".codex").mkdir(exist_ok=True)
            (home / ".codex" / "config.toml").write_text(codex_config(url, model))
            env["SWITCHYARD_API_KEY"] = "none"
        elif self.name == "qwen-code":
            (home / ".qwen").mkdir(exist_ok=True)
            (home / ".qwen" / "settings.json").write_text(qwen_code_settings())
            env |= qwen_code_env(url, model)
        elif self.name == "opencode":
            config = home / ".config" / "opencode"
            config.mkdir(parents=True, exist_ok=True)
            (config / "opencode.json").write_text(opencode_config(url, model))
        return env

    def turn(self, n: int, prompt: str) -> list[str]:
        """argv of turn `n` (1: a new session; 2: the same session continued), headless."""
        exe = str(self.path)
        if self.name == "claude-code":
            return [exe, "-p", *(["--continue"] if n > 1 else []), prompt,
                    "--output-format", "json"]
        if self.name == "codex":
            return ([exe, "exec", "--skip-git-repo-check", "--json", prompt] if n == 1 else
                    [exe, "exec", "resume", "--skip-git-repo-check", "--json", "--last", prompt])
        if self.name == "qwen-code":
            return [exe, *(["--continue"] if n > 1 else []), "--output-format", "json", prompt]
        if self.name == "opencode":
            return [exe, "run", *(["--continue"] if n > 1 else []), "--format", "json", prompt]
        raise ValueError(self.name)

    def version(self) -> str:
        meta = clients_dir() / "node_modules" / self.package / "package.json"
        return json.loads(meta.read_text())["version"]


CLIENTS = {c.name: c for c in (
    Client("claude-code", "@anthropic-ai/claude-code", "claude", "anthropic"),
    Client("codex", "@openai/codex", "codex", "responses"),
    Client("qwen-code", "@qwen-code/qwen-code", "qwen", "chat"),
    Client("opencode", "opencode-ai", "opencode", "chat"),
)}


def doc_blocks(name: str) -> list[str]:
    """docs/clients.md's code blocks for client `name` (URL DOC_URL, model DOC_MODEL)."""
    url, model = DOC_URL, DOC_MODEL
    if name == "claude-code":
        return [_exports(claude_code_env(url, model)) + "claude\n"]
    if name == "codex":
        return [codex_config(url, model), "export SWITCHYARD_API_KEY=none\ncodex\n"]
    if name == "qwen-code":
        return [_exports(qwen_code_env(url, model)) + "qwen\n", qwen_code_settings()]
    if name == "opencode":
        return [opencode_config(url, model)]
    raise ValueError(name)


# -- installing ---------------------------------------------------------------------------------

def install(refresh_s: float = REFRESH_S, timeout_s: float = 600.0) -> dict[str, str]:
    """Install (or refresh, when older than `refresh_s`) every client with npm into
    clients_dir(); return {name: version}. Raises ClientsUnavailable with the reason."""
    root = clients_dir()
    stamp = root / ".installed"
    fresh = stamp.exists() and time.time() - stamp.stat().st_mtime < refresh_s
    have = all(c.path.exists() for c in CLIENTS.values())
    if not (fresh and have):
        npm = shutil.which("npm")
        if npm is None:
            raise ClientsUnavailable("npm is not installed (Debian: apt-get install nodejs npm)")
        root.mkdir(parents=True, exist_ok=True)
        if not (root / "package.json").exists():
            (root / "package.json").write_text('{"private": true}\n')
        cmd = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error",
               *(f"{c.package}@latest" for c in CLIENTS.values())]
        try:
            done = subprocess.run(cmd, cwd=root, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClientsUnavailable(f"npm install failed: {exc}") from None
        if done.returncode != 0:
            raise ClientsUnavailable(f"npm install failed: {last_error_line(done)}")
        stamp.touch()
    missing = [c.name for c in CLIENTS.values() if not c.path.exists()]
    if missing:
        raise ClientsUnavailable(f"npm installed no binary for {', '.join(missing)}")
    return {c.name: c.version() for c in CLIENTS.values()}


def last_error_line(done: subprocess.CompletedProcess) -> str:
    """What a failed installer said last on stderr (its exit code when it said nothing)."""
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {done.returncode}"
