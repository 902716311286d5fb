"""Claude Code–shaped load on a real model, Switchyard vs mlx_lm.server vs vllm-mlx.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python bench/agent_traffic.py [--model M.gguf] [--agents 20] [--turns 6]
        [--grow-to 20000] [--slots 4] [--servers switchyard,mlx_lm,vllm_mlx] [--plot T.png]
        [--shape claude-code|synthetic]

Workload (deterministic, `--seed`): a main session and `--agents` sub-agents, all sending what
Claude Code sends: Anthropic Messages requests, streamed, whose system prompt starts with an
`x-anthropic-billing-header:` line that changes on every request, then the shared system
prompt and tools; `tool_use` / `tool_result` turns. `--shape claude-code` (default): the
system blocks, all 12 tools and the mid-conversation `role: "system"` message of Claude Code
2.1.332's recorded first request (tests/corpus), that message right after each
conversation's first user message as Claude Code sends it (its searches and notes go through
Bash and Write: it has no Glob, Grep or TodoWrite). `--shape synthetic` (the first sittings):
a system prompt of about `--system` tokens and 20 tool definitions (Task, Bash, Glob, Grep,
Read, Edit, Write, TodoWrite, WebFetch, ... with JSON schemas), no system message.
- The main session sends its request (turn 0), then one assistant message with `--agents`
  parallel `Task` calls; every sub-agent runs at once.
- A sub-agent shares the main session's system prompt and tools. Its own tool loop: its task,
  then `--turns` tool calls (Glob, Grep, Read, Edit, Bash, TodoWrite, scripted and seeded),
  each answered by a tool result of realistic text (numbered file contents, grep lines, test
  output) sized so its last prompt is about `--grow-to` tokens (within the context), then its
  final turn. A request is sent as soon as the previous reply of that conversation ends.
- When every sub-agent is done, the main session sends their reports as the Task results.
- The model's replies are capped at `--reply` tokens and not carried into the history (the
  assistant turns are scripted), so every server sees the same conversations.

Servers, one at a time on the same machine:
- `switchyard`: the model as given (`--model`, default the embedded default model), `--slots`,
  `--max-running`.
- `mlx_lm`: `mlx_lm.server` of this venv, default prompt-cache settings.
- `vllm_mlx`: vllm-mlx 0.6.0 from its own venv (bench/_peers.py installs it once),
  `--continuous-batching --enable-prefix-cache --ssd-cache-dir --ssd-cache-max-gb`, own HOME.
The peers speak OpenAI chat completions: the same conversation as chat messages with tool
calls and tool messages, the billing line left out as Switchyard removes it, the system
message where Switchyard's gateway puts it (in place where the template writes it there, else
joined to the user message before it), so the chat template renders the same tokens
(checked: each server's prompt token count against the bench's own rendering). A GGUF
`--model` reaches the peers as a Hugging Face directory (built once, bench/_peers.py):
`--weights same` (default) holds exactly the GGUF loader's weights, so all three run the same
kernels on the same numbers; `f16` / `f32` dequantize them, and then Switchyard serves that
directory too.

Reported per server: wall time (the main session's first request to its last reply), TTFT
p50 / p95 / max over every request, tokens re-read beyond each request's new ones (prompt -
cached - new, where new is the growth over the conversation's previous prompt, or over the
main session's first prompt for a sub-agent's first request: what a perfect cache still
reads) from each server's own counter (Switchyard: usage `cache_read_input_tokens`;
mlx_lm.server: usage `cached_tokens`; vllm-mlx: its log's `[cache_fetch]` / `[ssd_promote]`
lines, matched by prompt length), and the peak RSS and PSS summed over the server's whole
process tree. Every figure is measured in one run on a shared machine: compare, do not quote
absolutes.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from bench._common import (MODELS, Streamed, fmt, model_dir, preload_note,  # noqa: E402
                           stream, table)
from bench._peers import (PEER_WEIGHTS, TreeMemory, hf_export, mlx_lm_server,  # noqa: E402
                          vllm_cached_tokens, vllm_mlx_server)
from switchyard.testing.group import ServerGroup  # noqa: E402

SERVERS = ("switchyard", "mlx_lm", "vllm_mlx")
CLAUDE_MODEL = "claude-sonnet-4-5-20250929"
# --background-subagents: the name the sub-agents ask for (Claude Code's
# CLAUDE_CODE_SUBAGENT_MODEL), which Switchyard serves with --background-model.
SUBAGENT_MODEL = "claude-subagents"
ROOT = "/home/dev/shipyard"

# --- tools, as Claude Code defines them (names and schemas; descriptions shortened) -----------


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}


_S = {"type": "string"}
_N = {"type": "number"}
_B = {"type": "boolean"}
TOOLS = [
    ("Task", "Launch a new agent to handle complex, multi-step tasks autonomously. The agent "
     "gets the tools listed for its type and returns one final report.",
     _obj({"description": _S | {"description": "A short (3-5 word) description of the task"},
           "prompt": _S | {"description": "The task for the agent to perform"},
           "subagent_type": _S | {"description": "The type of specialized agent to use"}},
          ["description", "prompt", "subagent_type"])),
    ("Bash", "Executes a bash command in a persistent shell session with an optional timeout. "
     "Quote paths with spaces; prefer the dedicated tools for reading and searching files.",
     _obj({"command": _S | {"description": "The command to execute"},
           "timeout": _N | {"description": "Optional timeout in milliseconds (max 600000)"},
           "description": _S | {"description": "Clear, concise description of what this "
                                "command does in 5-10 words"},
           "run_in_background": _B | {"description": "Run this command in the background"}},
          ["command"])),
    ("Glob", "Fast file pattern matching that works with any codebase size. Returns matching "
     "file paths sorted by modification time.",
     _obj({"pattern": _S | {"description": "The glob pattern to match files against"},
           "path": _S | {"description": "The directory to search in; defaults to the cwd"}},
          ["pattern"])),
    ("Grep", "A powerful search tool built on ripgrep. Supports full regex syntax, file type "
     "and glob filters, and three output modes.",
     _obj({"pattern": _S | {"description": "The regular expression pattern to search for"},
           "path": _S | {"description": "File or directory to search in"},
           "glob": _S | {"description": "Glob pattern to filter files (e.g. \"*.js\")"},
           "output_mode": {"type": "string", "enum": ["content", "files_with_matches", "count"],
                           "description": "Output mode"},
           "-B": _N | {"description": "Lines to show before each match"},
           "-A": _N | {"description": "Lines to show after each match"},
           "-C": _N | {"description": "Lines to show before and after each match"},
           "-n": _B | {"description": "Show line numbers in output"},
           "-i": _B | {"description": "Case insensitive search"},
           "type": _S | {"description": "File type to search (rg --type)"},
           "head_limit": _N | {"description": "Limit output to the first N lines/entries"},
           "multiline": _B | {"description": "Enable multiline mode"}},
          ["pattern"])),
    ("LS", "Lists files and directories in a given path. The path must be absolute.",
     _obj({"path": _S | {"description": "The absolute path to the directory to list"},
           "ignore": {"type": "array", "items": _S, "description": "Glob patterns to ignore"}},
          ["path"])),
    ("ExitPlanMode", "Use this tool when you are in plan mode and have finished presenting your "
     "plan and are ready to code.",
     _obj({"plan": _S | {"description": "The plan you came up with, in markdown"}}, ["plan"])),
    ("Read", "Reads a file from the local filesystem. Results are returned using cat -n format, "
     "with line numbers starting at 1.",
     _obj({"file_path": _S | {"description": "The absolute path to the file to read"},
           "offset": _N | {"description": "The line number to start reading from"},
           "limit": _N | {"description": "The number of lines to read"}}, ["file_path"])),
    ("Edit", "Performs exact string replacements in files. The edit fails if old_string is not "
     "unique in the file unless replace_all is set.",
     _obj({"file_path": _S | {"description": "The absolute path to the file to modify"},
           "old_string": _S | {"description": "The text to replace"},
           "new_string": _S | {"description": "The text to replace it with"},
           "replace_all": _B | {"description": "Replace all occurrences", "default": False}},
          ["file_path", "old_string", "new_string"])),
    ("MultiEdit", "Makes multiple edits to a single file in one operation, applied in order.",
     _obj({"file_path": _S | {"description": "The absolute path to the file to modify"},
           "edits": {"type": "array", "minItems": 1, "items": _obj(
               {"old_string": _S, "new_string": _S, "replace_all": _B},
               ["old_string", "new_string"])}}, ["file_path", "edits"])),
    ("Write", "Writes a file to the local filesystem, overwriting the existing file if any.",
     _obj({"file_path": _S | {"description": "The absolute path to the file to write"},
           "content": _S | {"description": "The content to write to the file"}},
          ["file_path", "content"])),
    ("NotebookEdit", "Completely replaces the contents of a specific cell in a Jupyter notebook.",
     _obj({"notebook_path": _S, "cell_id": _S, "new_source": _S,
           "cell_type": {"type": "string", "enum": ["code", "markdown"]},
           "edit_mode": {"type": "string", "enum": ["replace", "insert", "delete"]}},
          ["notebook_path", "new_source"])),
    ("WebFetch", "Fetches content from a URL and processes it using a small, fast model.",
     _obj({"url": _S | {"format": "uri", "description": "The URL to fetch content from"},
           "prompt": _S | {"description": "The prompt to run on the fetched content"}},
          ["url", "prompt"])),
    ("TodoWrite", "Create and manage a structured task list for the current coding session.",
     _obj({"todos": {"type": "array", "items": _obj(
         {"content": {"type": "string", "minLength": 1},
          "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]},
          "activeForm": {"type": "string", "minLength": 1}},
         ["content", "status", "activeForm"]), "description": "The updated todo list"}},
         ["todos"])),
    ("WebSearch", "Searches the web and uses the results to inform responses.",
     _obj({"query": _S | {"minLength": 2, "description": "The search query to use"},
           "allowed_domains": {"type": "array", "items": _S},
           "blocked_domains": {"type": "array", "items": _S}}, ["query"])),
    ("BashOutput", "Retrieves output from a running or completed background bash shell.",
     _obj({"bash_id": _S | {"description": "The ID of the background shell"},
           "filter": _S | {"description": "Optional regular expression to filter lines"}},
          ["bash_id"])),
    ("KillShell", "Kills a running background bash shell by its ID.",
     _obj({"shell_id": _S | {"description": "The ID of the background shell to kill"}},
          ["shell_id"])),
    ("SlashCommand", "Execute a slash command within the main conversation.",
     _obj({"command": _S | {"description": "The slash command with arguments"}}, ["command"])),
    ("AskUserQuestion", "Ask the user questions with multiple-choice answers during execution.",
     _obj({"questions": {"type": "array", "minItems": 1, "maxItems": 4, "items": _obj(
         {"question": _S, "header": _S, "multiSelect": _B,
          "options": {"type": "array", "items": _obj({"label": _S, "description": _S},
                                                      ["label", "description"])}},
         ["question", "header", "options", "multiSelect"])}}, ["questions"])),
    ("mcp__ide__getDiagnostics", "Get language diagnostics from the IDE.",
     _obj({"uri": _S | {"description": "Optional file URI to get diagnostics for"}}, [])),
    ("mcp__ide__executeCode", "Execute python code in the Jupyter kernel of the current "
     "notebook file.",
     _obj({"code": _S | {"description": "The code to be executed on the kernel"}}, ["code"])),
]
ANTHROPIC_TOOLS = [{"name": n, "description": d, "input_schema": s} for n, d, s in TOOLS]

SYSTEM_CORE = """You are an interactive command line agent that helps users with software \
engineering tasks. Use the instructions below and the tools available to you to assist the user.

# Tone and style
Be concise, direct and to the point. Answer in fewer than four lines unless the user asks for \
detail. Do not add preamble or postamble. Never invent URLs.

# Doing tasks
The user will mostly ask you to fix bugs, add functionality, refactor code or explain code.
- Use the TodoWrite tool to plan the task if it has several steps.
- Use the search tools to understand the codebase and the user's query. Search in parallel.
- Implement the solution using all tools available to you.
- Verify the solution with the project's tests. Never assume a test framework: read the README.
- Run the lint and typecheck commands when you have completed a task.

# Tool usage policy
- When doing file search, prefer the Task tool to reduce context usage.
- You can call multiple tools in a single response. Batch independent tool calls together.
- Prefer Read, Grep and Glob over cat, grep and find in Bash.

<env>
Working directory: /home/dev/shipyard
Is directory a git repo: Yes
Platform: linux
Today's date: 2025-06-02
</env>

# Project instructions (CLAUDE.md)
"""

# --- request shapes: the synthetic one above, or Claude Code's as recorded ---------------------

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "corpus" / "claude-code-2.1.332"
SHAPES = ("claude-code", "synthetic")
EPHEMERAL = {"type": "ephemeral"}


@dataclass
class Shape:
    """What every request of a conversation carries around its own turns: the system prompt's
    Anthropic blocks (after the billing line), the tools, the user-side blocks before a
    conversation's first prompt, and the `role: "system"` message Claude Code sends right after
    the first user message (None: none)."""

    name: str
    system_blocks: list[dict]
    anthropic_tools: list[dict]
    reminders: list[str]
    mid_system: dict | None
    spawn_tool: str  # the tool the main session launches sub-agents with

    @property
    def system(self) -> str:
        """The system prompt as Switchyard's Anthropic route joins its blocks."""
        return "\n".join(b["text"] for b in self.system_blocks)

    @property
    def openai_tools(self) -> list[dict]:
        from switchyard.gateway.request.tools import function_tool

        return [function_tool(t["name"], t.get("description"), t.get("input_schema"))
                for t in self.anthropic_tools]

    @property
    def mid_system_text(self) -> str | None:
        if self.mid_system is None:
            return None
        c = self.mid_system["content"]
        return c if isinstance(c, str) else "\n".join(b["text"] for b in c)


def synthetic_shape(system: str, reminder: str) -> Shape:
    """The bench's first shape: SYSTEM_CORE plus seeded instructions, TOOLS."""
    return Shape("synthetic", [{"type": "text", "text": system, "cache_control": EPHEMERAL}],
                 ANTHROPIC_TOOLS, [reminder], None, "Task")


def claude_code_shape(corpus: Path = CORPUS) -> Shape:
    """Claude Code 2.1.332's first request as recorded (tests/corpus): its system blocks less
    the billing line (the bench writes a fresh one per request), all its tools, the user-side
    `<system-reminder>` blocks before its prompt, and the system message after the first user
    message (its list of agent types, skills and environment)."""
    body = json.loads((corpus / "turn1.json").read_text())["body"]
    blocks = [b for b in body["system"]
              if not b["text"].startswith("x-anthropic-billing-header:")]
    roles = [m["role"] for m in body["messages"]]
    if roles != ["user", "system"]:
        raise ValueError(f"{corpus}/turn1.json: expected a user message, then a system "
                         f"message; found {roles}")
    first, mid = body["messages"]
    reminders = [b["text"] for b in first["content"][:-1]]  # the last block is the prompt
    return Shape("claude-code", blocks, body["tools"], reminders, mid, "Agent")


WORDS = ("request handler config session cache page slot token buffer worker queue router "
         "payload result client server stream event record index store state limit budget "
         "timeout retry batch prompt reply tool layout journal ledger cursor window shard "
         "replica policy grant scope frame packet digest schema").split()
TYPES = ("int", "str", "bytes", "float", "bool", "dict[str, Any]", "list[int]", "Path",
         "Request", "Response", "Page", "Slot")
VERBS = ("Load", "Parse", "Check", "Build", "Merge", "Split", "Flush", "Resolve", "Encode",
         "Decode", "Release", "Acquire", "Schedule", "Restore")
MODULES = ("gateway/router.py", "gateway/streaming.py", "scheduler/queue.py",
           "scheduler/budget.py", "worker/slots.py", "worker/prefill.py", "kvstore/pages.py",
           "kvstore/journal.py", "proto/codec.py", "deploy/supervisor.py", "cli/main.py",
           "tests/test_router.py", "tests/test_pages.py", "tests/test_budget.py")


class Text:
    """Seeded generators of realistic tool output: code, grep lines, test runs."""

    def __init__(self, rng: random.Random, count) -> None:
        self.rng = rng
        self.count = count  # text -> tokens

    def w(self) -> str:
        return self.rng.choice(WORDS)

    def code_line(self, depth: int) -> str:
        r, w, ind = self.rng, self.w, "    " * depth
        kind = r.randrange(9)
        if kind == 0:
            return (f"{ind}def {w()}_{w()}(self, {w()}: {r.choice(TYPES)}, {w()}: int = "
                    f"{r.randrange(100)}) -> {r.choice(TYPES)}:")
        if kind == 1:
            return f'{ind}    """{r.choice(VERBS)} the {w()} {w()} and return the {w()}."""'
        if kind == 2:
            return f"{ind}    {w()} = self.{w()}.get({w()!r}, {r.randrange(1000)})"
        if kind == 3:
            return f"{ind}    if {w()} is None or {w()}.{w()} > {r.randrange(64)}:"
        if kind == 4:
            a = w()
            return f'{ind}        raise ValueError(f"{a} {w()}: {{{a}!r}}")'
        if kind == 5:
            return f"{ind}    for {w()} in self.{w()}s[{r.randrange(8)}:]:"
        if kind == 6:
            return f"{ind}        {w()}.{w()}_{w()}({w()}, timeout={r.randrange(1, 60)}.0)"
        if kind == 7:
            return f"{ind}    return {w()}_{w()}"
        return f"{ind}    # {r.choice(VERBS).lower()} the {w()} before the {w()} is {w()}ed"

    def sized(self, tokens: int, line) -> str:
        lines, n = [], 0
        while n < tokens:
            text = line(len(lines))
            lines.append(text)
            n += self.count(text + "\n")
        return "\n".join(lines)

    def file(self, tokens: int, start: int = 1) -> str:
        return self.sized(
            tokens, lambda i: f"{start + i:>6}\t{self.code_line(self.rng.randrange(2))}")

    def grep(self, tokens: int) -> str:
        return self.sized(tokens, lambda i: f"{ROOT}/{self.rng.choice(MODULES)}:"
                          f"{self.rng.randrange(1, 900)}:{self.code_line(1).strip()}")

    def glob(self, tokens: int) -> str:
        return self.sized(tokens, lambda i: f"{ROOT}/{self.w()}/{self.w()}_{self.w()}.py")

    def bash(self, tokens: int) -> str:
        def line(i: int) -> str:
            r = self.rng
            if i == 0:
                return ("============ test session starts ============ platform linux, "
                        f"{r.randrange(50, 400)} items")
            if r.random() < 0.12:
                return (f"FAILED tests/test_{self.w()}.py::test_{self.w()}_{self.w()} - "
                        f"AssertionError: assert {r.randrange(99)} == {r.randrange(99)}")
            if r.random() < 0.3:
                return f"E       {self.code_line(0).strip()}"
            return (f"tests/test_{self.w()}.py::test_{self.w()}_{self.w()} PASSED "
                    f"[{r.randrange(100):>3}%]")
        return self.sized(tokens, line)

    def edit(self, tokens: int, path: str) -> str:
        head = (f"The file {path} has been updated. Here's the result of running `cat -n` on a "
                "snippet of the edited file:\n")
        return head + self.file(max(8, tokens - self.count(head)), self.rng.randrange(1, 400))


# --- the conversations ----------------------------------------------------------------------------


@dataclass
class Call:
    id: str
    name: str
    input: dict


@dataclass
class Msg:
    role: str  # "user" | "assistant" | "results" | "system" (the shape's mid_system)
    texts: list[str] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    results: list[tuple[str, str]] = field(default_factory=list)  # (tool_use_id, content)


@dataclass
class Request:
    conv: str  # "main" or "agent i"
    turn: int
    messages: list[Msg]
    prompt_ids: list[int] = field(default_factory=list)
    new: int = 0  # prompt tokens beyond the longest prefix a perfect cache would hold


# Tool sequence of a sub-agent and the relative size of each tool's result.
PLAN = ["Glob", "Grep", "Read", "Read", "Edit", "Bash", "Grep", "Read", "Edit", "TodoWrite",
        "Read", "Bash"]
WEIGHT = {"Glob": 0.35, "Grep": 0.9, "Read": 1.6, "Edit": 0.6, "Bash": 1.0, "TodoWrite": 0.05}
SAYS = {"Glob": "Let me find the files involved.", "Grep": "I'll search for where it is used.",
        "Read": "Let me read this file.", "Edit": "Now I'll make the change.",
        "Bash": "Let me run the tests.", "TodoWrite": "I'll update the todo list."}
TODO_RESULT = ("Todos have been modified successfully. Ensure that you continue to use the todo "
               "list to track your progress. Please proceed with the current tasks if applicable")


class Workload:
    def __init__(self, args, tokenizer) -> None:
        self.args = args
        self.tok = tokenizer
        self.rng = random.Random(args.seed)
        self.text = Text(self.rng, self.count)
        if args.shape == "synthetic":
            self.shape = synthetic_shape(
                SYSTEM_CORE + self._instructions(args.system - self.count(SYSTEM_CORE)),
                "<system-reminder>\nAs you answer the user's questions, you can use the "
                "following context: the project's CLAUDE.md is above. IMPORTANT: this context "
                "may or may not be relevant to your tasks.\n</system-reminder>")
        else:
            self.shape = claude_code_shape()
        self.system = self.shape.system
        self.openai_tools = self.shape.openai_tools
        # Claude Code's system message right after a conversation's first user message.
        self.mid = [Msg("system", [self.shape.mid_system_text])] if self.shape.mid_system \
            else []
        self.main_request = Msg("user", [
            *self.shape.reminders,
            "The page cache evicts pages a queued request still needs. Investigate every module "
            f"that touches pages in parallel ({args.agents} agents), fix what you find and run "
            "the tests."])
        self.tasks = [self._task(i) for i in range(args.agents)]
        self.spawn = Msg("assistant", [f"I'll launch {args.agents} agents in parallel, one per "
                                       "area of the codebase."],
                         calls=[Call(self._id(), self.shape.spawn_tool, {
                             "description": f"Investigate area {i}",
                             "prompt": self.tasks[i], "subagent_type": "general-purpose"})
                             for i in range(args.agents)])
        self.agents = [self._agent(i) for i in range(args.agents)]
        self.reports = [self._report(i) for i in range(args.agents)]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def _id(self) -> str:
        alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz123456789"
        return "toolu_01" + "".join(self.rng.choice(alphabet) for _ in range(22))

    def _instructions(self, tokens: int) -> str:
        t = self.text
        return t.sized(max(0, tokens), lambda i: (
            f"- {t.rng.choice(VERBS)} the {t.w()} {t.w()} in `{t.rng.choice(MODULES)}` before "
            f"touching the {t.w()}; run `pytest -q tests/test_{t.w()}.py` after each change."))

    def _task(self, i: int) -> str:
        module = MODULES[i % len(MODULES)]
        return (f"Investigate how `{module}` and its callers handle pages that a queued request "
                f"will restore (area {i}). Read the relevant code, fix what evicts them too early, "
                "run the tests, and report the files changed and the results in a few lines.")

    def _input(self, name: str, module: str) -> dict:
        t, r = self.text, self.rng
        path = f"{ROOT}/{module}"
        if name == "Glob":
            return {"pattern": f"**/{t.w()}*.py", "path": ROOT}
        if name == "Grep":
            return {"pattern": f"def {t.w()}_|{t.w()}\\.{t.w()}", "path": ROOT,
                    "output_mode": "content", "-n": True}
        if name == "Read":
            return {"file_path": path, "offset": r.randrange(1, 300), "limit": 200}
        if name == "Edit":
            return {"file_path": path, "old_string": t.code_line(1), "new_string": t.code_line(1)}
        if name == "Bash":
            return {"command": f"python -m pytest -q tests/test_{t.w()}.py",
                    "description": "Run the tests"}
        return {"todos": [{"content": f"{v} the {t.w()} {t.w()}", "status": s,
                           "activeForm": f"{v}ing the {t.w()}"}
                          for v, s in zip(r.sample(VERBS, 3),
                                          ("completed", "in_progress", "pending"))]}

    def _corpus_call(self, name: str, inp: dict) -> tuple[str, dict]:
        """The synthetic call `name` as Claude Code 2.1.332 makes it with its own tools (it has
        no Glob, Grep or TodoWrite: searches go through Bash, notes through Write)."""
        if name == "Glob":
            return "Bash", {"command": f"rg --files -g '{inp['pattern']}' {inp['path']}",
                            "description": "List the matching files"}
        if name == "Grep":
            return "Bash", {"command": f"rg -n '{inp['pattern']}' {inp['path']}",
                            "description": "Search the code"}
        if name == "TodoWrite":
            return "Write", {"file_path": f"{ROOT}/NOTES.md", "content": "\n".join(
                f"- [{'x' if t['status'] == 'completed' else ' '}] {t['content']}"
                for t in inp["todos"])}
        return name, inp

    def _result(self, name: str, tokens: int, call: Call) -> str:
        t = self.text
        if name == "Glob":
            return t.glob(tokens)
        if name == "Grep":
            return t.grep(tokens)
        if name == "Read":
            return t.file(tokens, call.input["offset"])
        if name == "Edit":
            return t.edit(tokens, call.input["file_path"])
        if name == "Bash":
            return t.bash(tokens)
        if call.name == "Write":
            return f"The file {call.input['file_path']} has been updated successfully."
        return TODO_RESULT

    def _agent(self, i: int) -> list[Msg]:
        """The sub-agent's whole history: task, then (tool call, result) per turn."""
        a = self.args
        names = [PLAN[(i + k) % len(PLAN)] for k in range(a.turns)]
        # Result sizes: the room left below --grow-to shared by weight, +-10% per agent.
        # (The tool list is written into the prompt too: about its JSON's tokens.)
        first = self._agent_first(i)
        base = (self.count(self.system) + self.count(json.dumps(self.openai_tools))
                + sum(self.count(x) for m in first for x in m.texts) + 40)
        room = max(0, a.grow_to - base - a.turns * 60)
        total = sum(WEIGHT[n] for n in names) or 1
        jitter = 0.9 + 0.2 * self.rng.random()
        module = MODULES[i % len(MODULES)]
        msgs = first
        for name in names:
            call = Call(self._id(), name, self._input(name, module))
            if self.shape.name == "claude-code":
                call.name, call.input = self._corpus_call(name, call.input)
            msgs.append(Msg("assistant", [SAYS[name]], [call]))
            size = int(room * WEIGHT[name] / total * jitter)
            msgs.append(Msg("results", results=[(call.id, self._result(name, size, call))]))
        return msgs

    def _agent_first(self, i: int) -> list[Msg]:
        """A sub-agent's first messages: its task (after the shape's reminders when the shape
        is Claude Code's, whose every conversation opens so), then the mid-conversation system
        message."""
        reminders = self.shape.reminders if self.shape.name == "claude-code" else []
        return [Msg("user", [*reminders, self.tasks[i]]), *self.mid]

    def _report(self, i: int) -> str:
        t = self.text
        files = ", ".join(f"`{m}`" for m in self.rng.sample(MODULES, 3))
        return (f"Area {i}: changed {files}. The {t.w()} {t.w()} was released before the queued "
                f"request's restore; it now keeps a pin until the {t.w()} is placed. Tests: "
                f"{self.rng.randrange(20, 90)} passed, 0 failed.")

    # requests, in the order a conversation sends them

    def main_first(self) -> list[Msg]:
        return [self.main_request, *self.mid]

    def main_last(self) -> list[Msg]:
        return [self.main_request, *self.mid, self.spawn,
                Msg("results", results=[(c.id, r) for c, r in zip(self.spawn.calls, self.reports)])]

    def agent_turn(self, i: int, turn: int) -> list[Msg]:
        return self.agents[i][: 1 + len(self.mid) + 2 * turn]

    def requests(self) -> list[Request]:
        out = [Request("main", 0, self.main_first()), Request("main", 1, self.main_last())]
        for i in range(self.args.agents):
            out += [Request(f"agent {i}", t, self.agent_turn(i, t))
                    for t in range(self.args.turns + 1)]
        return out


# --- rendering: Anthropic for Switchyard, OpenAI chat for the peers ------------------------------


def billing_line(n: int) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.0.{n % 97}.a1b; cc_entrypoint=cli; "
            f"cch={n:05x};")


def anthropic_body(w: Workload, msgs: list[Msg], n: int, model: str = CLAUDE_MODEL) -> dict:
    messages = []
    for m in msgs:
        if m.role == "user":
            messages.append({"role": "user",
                             "content": [{"type": "text", "text": t} for t in m.texts]})
        elif m.role == "system":
            messages.append(w.shape.mid_system)  # as recorded
        elif m.role == "assistant":
            messages.append({"role": "assistant", "content": [
                *({"type": "text", "text": t} for t in m.texts),
                *({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input}
                  for c in m.calls)]})
        else:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": i, "content": r} for i, r in m.results]})
    return {"model": model, "max_tokens": w.args.reply, "temperature": 0,
            "stream": True, "metadata": {"user_id": "user_bench_account__session_0001"},
            "system": [{"type": "text", "text": billing_line(n)}, *w.shape.system_blocks],
            "tools": w.shape.anthropic_tools, "messages": messages}


def openai_messages(w: Workload, msgs: list[Msg]) -> list[dict]:
    """The chat messages Switchyard's Anthropic route makes of the same request."""
    out = [{"role": "system", "content": w.system}]
    for m in msgs:
        if m.role in ("user", "system"):
            out.append({"role": m.role, "content": "\n".join(m.texts)})
        elif m.role == "assistant":
            out.append({"role": "assistant", "content": "\n".join(m.texts), "tool_calls": [
                {"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.dumps(c.input, ensure_ascii=False)}}
                for c in m.calls]})
        else:
            out += [{"role": "tool", "tool_call_id": i, "content": r} for i, r in m.results]
    return out


def openai_body(w: Workload, msgs: list[Msg], model: str) -> dict:
    """The peers' request: the chat messages and tools their template renders, so they read
    the same tokens as Switchyard (with a template that renders no tools, the tool list,
    calls and results written as text, as Switchyard's gateway writes them)."""
    messages, tools = template_messages(w, msgs, string_arguments=True)
    body = {"model": model, "messages": messages, "max_tokens": w.args.reply,
            "temperature": 0}
    if tools:
        body["tools"] = tools
    return body


def template_messages(w: Workload, msgs: list[Msg], string_arguments: bool = False
                      ) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools the chat template gets for this request on Switchyard.

    A system message after the first user turn stays where it stands when the template writes
    it there; otherwise its text joins the user message before it, as Switchyard's gateway does
    (gateway/prompting/system_turns.py): the peers are sent that equivalent, not a system
    message their template would drop, hoist or refuse."""
    from switchyard.gateway.output.formats import detect_format
    from switchyard.gateway.prompting.system_turns import (place_system_messages,
                                                            renders_system_in_place)
    from switchyard.gateway.prompting.tool_text import messages_with_tools_as_text, text_syntax

    m, _ = place_system_messages(openai_messages(w, msgs), renders_system_in_place(w.tok))
    tools = w.openai_tools
    syntax = text_syntax(w.tok, detect_format(w.tok).tools)
    if syntax is None and string_arguments:
        return m, tools  # the template renders tools and calls itself: OpenAI's shapes
    for msg in m:  # as templates receive them (switchyard.gateway.prompting.history)
        for c in msg.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    # A template that renders no tools (SmolLM2's ChatML) gets them as text, as the gateway
    # writes them: otherwise every prompt would miss the tool list.
    if syntax is not None:
        m, tools = messages_with_tools_as_text(m, tools, syntax), None
    return m, tools


def render_ids(w: Workload, msgs: list[Msg]) -> list[int]:
    m, tools = template_messages(w, msgs)
    text = w.tok.apply_chat_template(m, tools=tools, add_generation_prompt=True,
                                     tokenize=False)
    return list(w.tok.encode(text, add_special_tokens=False))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prepare(w: Workload, ctx: int) -> dict[tuple[str, int], Request]:
    reqs = {(r.conv, r.turn): r for r in w.requests()}
    for r in reqs.values():
        r.prompt_ids = render_ids(w, r.messages)
        if len(r.prompt_ids) + w.args.reply > ctx:
            raise SystemExit(f"{r.conv} turn {r.turn}: {len(r.prompt_ids)} prompt tokens + "
                             f"{w.args.reply} > context {ctx}: lower --grow-to")
    first = reqs[("main", 0)].prompt_ids
    for r in reqs.values():
        prev = reqs.get((r.conv, r.turn - 1))
        held = prev.prompt_ids if prev else (first if r.conv != "main" else [])
        r.new = len(r.prompt_ids) - common_prefix(held, r.prompt_ids)
    return reqs


# --- streaming Anthropic ------------------------------------------------------------------------


def anthropic_stream(url: str, body: dict, client: httpx.Client) -> Streamed:
    out = Streamed(sent=time.perf_counter())
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "sk-bench",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
    with client.stream("POST", url + "/v1/messages", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            resp.read()
            out.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            out.finished = time.perf_counter()
            return out
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            obj = json.loads(line[6:])
            kind = obj.get("type")
            if kind == "message_start":
                out.rid = obj["message"]["id"]
            elif kind == "content_block_delta":
                delta = obj["delta"]
                if delta.get("text") or delta.get("partial_json") or delta.get("thinking"):
                    out.stamps.append(now)
            elif kind == "content_block_start" and obj["content_block"]["type"] == "tool_use":
                out.stamps.append(now)
            elif kind == "message_delta":
                out.finish_reason = obj["delta"].get("stop_reason")
                out.usage = obj.get("usage")
            elif kind == "error":
                out.error = str(obj.get("error"))[:300]
    out.finished = time.perf_counter()
    return out


# --- running -------------------------------------------------------------------------------------


@dataclass
class Done:
    req: Request
    res: Streamed
    prompt: int = 0  # as the server counted it
    cached: int | None = None  # the server's own count

    new: int = 0  # prompt tokens beyond the conversation's previous prompt, as counted here

    @property
    def reread(self) -> int:
        return max(0, self.prompt - (self.cached or 0) - self.new)


def count_new(done: list[Done]) -> None:
    """New tokens by the server's own prompt counts: vllm-mlx renders tool calls and results
    as text of its own when the template has no tool support, so its prompts are longer than
    the template's; the growth over the previous prompt of the conversation is what is new.
    A conversation's first request: what the bench's rendering says (the system prompt is
    rendered alike by all)."""
    by_key = {(d.req.conv, d.req.turn): d for d in done}
    for d in done:
        prev = by_key.get((d.req.conv, d.req.turn - 1))
        d.new = d.prompt - prev.prompt if prev else d.req.new


def run(server: str, url: str, w: Workload, reqs: dict, log, model: str = ""
        ) -> tuple[list[Done], float]:
    """Every request of the workload; `model`: the name a peer serves (its model path)."""
    done: list[Done] = []
    lock = threading.Lock()
    errors: list[str] = []
    counter = iter(range(10**9))

    def send(key: tuple[str, int], client: httpx.Client) -> bool:
        r = reqs[key]
        if server == "switchyard":
            asks = SUBAGENT_MODEL if w.args.background_subagents and r.conv != "main" \
                else CLAUDE_MODEL
            res = anthropic_stream(url, anthropic_body(w, r.messages, next(counter), asks),
                                   client)
        else:
            res = stream(url, "/v1/chat/completions", openai_body(w, r.messages, model),
                         client=client)
        if res.error:
            errors.append(f"{r.conv} turn {r.turn}: {res.error}")
            return False
        d = Done(r, res)
        u = res.usage or {}
        if server == "switchyard":
            d.cached = u.get("cache_read_input_tokens", 0)
            d.prompt = u.get("input_tokens", 0) + d.cached
        else:
            d.prompt = u.get("prompt_tokens", 0)
            details = u.get("prompt_tokens_details") or {}
            if server == "mlx_lm":
                d.cached = details.get("cached_tokens") or 0
        with lock:
            done.append(d)
        log(f"    {r.conv} turn {r.turn}: prompt {d.prompt}, ttft {res.ttft:6.2f}s")
        return True

    def agent(i: int) -> None:
        with httpx.Client(timeout=1800) as client:
            for t in range(w.args.turns + 1):
                if not send((f"agent {i}", t), client):
                    return

    t0 = time.perf_counter()
    with httpx.Client(timeout=1800) as client:
        if send(("main", 0), client):
            threads = [threading.Thread(target=agent, args=(i,)) for i in range(w.args.agents)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            if not errors:
                send(("main", 1), client)
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{server}: " + "; ".join(errors[:5]))
    return done, wall


def match_vllm(done: list[Done], log_text: str) -> None:
    """vllm-mlx reports cached tokens only in its log: give each request the first unclaimed
    log entry with its prompt length, in the order the requests were sent."""
    entries = vllm_cached_tokens(log_text)
    used = [False] * len(entries)
    for d in sorted(done, key=lambda d: d.res.sent):
        for k, (prompt, cached) in enumerate(entries):
            if not used[k] and prompt == d.prompt:
                used[k] = True
                d.cached = cached
                break


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def summarize(name: str, done: list[Done], wall: float, mem: TreeMemory) -> tuple[list, dict]:
    count_new(done)
    ttfts = [d.res.ttft for d in done]
    worst = max(done, key=lambda d: d.res.ttft)
    known = [d for d in done if d.cached is not None]
    reread = sum(d.reread for d in known)
    prefilled = sum(d.prompt - (d.cached or 0) for d in known)
    matches = sum(d.prompt == len(d.req.prompt_ids) for d in done)
    fig = dict(wall=wall, p50=percentile(ttfts, 0.5), p95=percentile(ttfts, 0.95),
               max=worst.res.ttft, worst=worst, reread=reread, rss=mem.peak_rss,
               pss=mem.peak_pss)
    row = [name, len(done), fmt(wall, 1), fmt(fig["p50"], 2), fmt(fig["p95"], 2),
           fmt(fig["max"], 2), f"{worst.req.conv} t{worst.req.turn}",
           reread if len(known) == len(done) else f"{reread} ({len(known)}/{len(done)} known)",
           prefilled, f"{matches}/{len(done)}", mib(mem.peak_rss), mib(mem.peak_pss)]
    return row, fig


def residency(done: list[Done], admitted: dict[str, float], turns: int, k: int) -> list[str]:
    """Agent-aware residency, measured before it is built: with RAM for `k`
    conversations, how many returning requests find theirs gone, and how many tokens those
    would restore (or re-read without a disk tier), under LRU, under "evict the conversations
    whose last reply ended the turn first, then LRU", and under Belady's furthest-next-use
    bound; requests in the order Switchyard admitted them (`admitted`: rid -> time)."""
    seq = sorted(done, key=lambda d: admitted.get(d.res.rid or "", d.res.sent))
    final = {d.req.conv: max(x.req.turn for x in done if x.req.conv == d.req.conv)
             for d in done}
    later = sum(1 for d in seq if d.req.turn > 0)
    lines = []
    for policy in ("LRU", "agent-aware", "Belady"):
        held: dict[str, tuple[float, bool, int]] = {}  # conv -> (last end, ended turn, next)
        last_prompt: dict[str, int] = {}
        misses = tokens = 0
        for i, d in enumerate(seq):
            c = d.req.conv
            if d.req.turn > 0 and c not in held:
                misses += 1
                tokens += last_prompt.get(c, 0)
            nxt = next((j for j in range(i + 1, len(seq)) if seq[j].req.conv == c), len(seq))
            held[c] = (d.res.finished, d.req.turn == final[c], nxt)
            last_prompt[c] = d.prompt
            while len(held) > k:
                others = [x for x in held if x != c]
                if policy == "LRU":
                    victim = min(others, key=lambda x: held[x][0])
                elif policy == "agent-aware":
                    victim = min(others, key=lambda x: (not held[x][1], held[x][0]))
                else:
                    victim = max(others, key=lambda x: held[x][2])
                del held[victim]
        lines.append(f"residency for {k} conversations, {policy}: {misses} of {later} returning "
                     f"requests miss, {tokens} tokens to restore (re-read without a disk tier)")
    return lines


def admission_times(group: ServerGroup, done: list[Done]) -> dict[str, float]:
    """rid -> when Switchyard's scheduler admitted the request (sent + its queue_s)."""
    from bench._common import log_events

    queue = {e["rid"]: e["queue_s"] for e in log_events(group.log_path, "request.finished")
             if e.get("role") == "scheduler" and "rid" in e}
    return {d.res.rid: d.res.sent + queue[d.res.rid] for d in done if d.res.rid in queue}


def switchyard_detail(group: ServerGroup, worst: Done) -> list[str]:
    from bench._common import log_events

    recs = [e for e in log_events(group.log_path, "request.finished")
            if e.get("role") == "scheduler"]
    lines = [f"switchyard: {len(recs)} request.finished lines; restored "
             f"{sum(e['num_restored_tokens'] for e in recs)} tokens, cached "
             f"{sum(e['num_cached_tokens'] for e in recs)}, prefilled "
             f"{sum(e['num_prefilled_tokens'] for e in recs)}; queue_s sum "
             f"{fmt(sum(e['queue_s'] for e in recs), 1)}, restore_s sum "
             f"{fmt(sum(e['restore_s'] for e in recs), 1)}"]
    for e in recs:
        if e.get("rid") == worst.res.rid:
            keys = ("queue_s", "restore_s", "prefill_wait_s", "prefill_s", "ttft_s")
            lines.append(f"switchyard's slowest request ({worst.req.conv} turn {worst.req.turn}): "
                         + ", ".join(f"{k} {fmt(e[k], 2)}" for k in keys if e.get(k) is not None)
                         + f"; prompt {e['num_prompt_tokens']}, cached {e['num_cached_tokens']}, "
                         f"restored {e['num_restored_tokens']}, prefilled "
                         f"{e['num_prefilled_tokens']}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf file or model directory, or a generated model of "
                    f"bench/_common.py ({', '.join(MODELS)}: random weights, for a smoke run) "
                    "(default: the embedded default model, switchyard.deploy.default_model)")
    ap.add_argument("--weights", choices=PEER_WEIGHTS, default="same",
                    help="a GGUF's weights for the peers: same (as Switchyard loads them) or "
                    "dequantized (then Switchyard serves the dequantized directory too)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--agents", type=int, default=20)
    ap.add_argument("--turns", type=int, default=6, help="tool calls per sub-agent")
    ap.add_argument("--shape", choices=SHAPES, default="claude-code",
                    help="the requests around each conversation's own turns: claude-code "
                    "(default): Claude Code 2.1.332's system prompt, tools and mid-conversation "
                    "system message as recorded in tests/corpus (the shared system prompt's size "
                    "is then the corpus's, about 12K tokens with its tools); synthetic: the "
                    "bench's first shape (20 tools, --system tokens), for older figures")
    ap.add_argument("--system", type=int, help="shared system prompt tokens, --shape synthetic "
                    "only (default 1200)")
    ap.add_argument("--grow-to", type=int,
                    help="a sub-agent's last prompt, tokens (about; within --ctx; default 20000 "
                    "for --shape claude-code, whose first prompt is about 12.4K tokens on "
                    "SmolLM2's tokenizer, 7000 for synthetic)")
    ap.add_argument("--reply", type=int, default=16, help="max_tokens of every request")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-running", type=int, default=0,
                    help="switchyard --max-running: requests run at once (0: its default, as "
                    "many as its memory plan holds, up to 4 x --slots)")
    ap.add_argument("--ctx", type=int, help="context per slot (default 24576 for --shape "
                    "claude-code, 8192 for synthetic)")
    ap.add_argument("--residency", type=int, default=4, metavar="K",
                    help="simulate LRU / agent-aware / Belady residency for K conversations "
                    "over Switchyard's admission order")
    ap.add_argument("--disk-budget", default="16GiB", help="Switchyard --kv-disk-budget")
    ap.add_argument("--ssd-gb", type=float, default=16, help="vllm-mlx --ssd-cache-max-gb")
    ap.add_argument("--background-subagents", action="store_true",
                    help="the sub-agents name a model Switchyard serves with --background-model "
                    "(as Claude Code's CLAUDE_CODE_SUBAGENT_MODEL would): their replies, which "
                    "no one reads as they stream, yield to waiting requests' prefill; the "
                    "peers get the same requests")
    ap.add_argument("--extra", default="", help="more switchyard serve flags, space-separated")
    ap.add_argument("--peer-extra", default="", help="more flags for both peers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-log", metavar="DIR", help="copy each server's log here")
    ap.add_argument("-q", "--quiet", action="store_true", help="no per-request lines")
    ap.add_argument("--plot", metavar="PNG", help="draw every request's TTFT against when it "
                    "was sent, one series per server, into this PNG (needs matplotlib: pip "
                    "install -e '.[bench]')")
    args = ap.parse_args()
    synthetic = args.shape == "synthetic"
    args.grow_to = args.grow_to or (7000 if synthetic else 20000)
    args.ctx = args.ctx or (8192 if synthetic else 24576)
    if synthetic:
        args.system = 1200 if args.system is None else args.system
    elif args.system is not None:
        ap.error("--system: only with --shape synthetic (Claude Code's system prompt is the "
                 "corpus's)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install -e '.[bench]'")
    if note := preload_note():
        print(note, file=sys.stderr)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if bad := set(servers) - set(SERVERS):
        ap.error(f"--servers: unknown {', '.join(sorted(bad))}; known: {', '.join(SERVERS)}")
    if args.model in MODELS and not Path(args.model).exists():
        model = model_dir(args.model)
    elif args.model:
        model = Path(args.model).expanduser()
    else:
        from switchyard.deploy.default_model import default_model_path

        model = default_model_path()
    peers = set(servers) - {"switchyard"}
    # The peers' directory is built only for a run that has peers (or dequantized weights).
    peer_model = hf_export(model, args.weights) if model.suffix == ".gguf" and (
        peers or args.weights != "same") else model
    ours = model if args.weights == "same" else peer_model

    from switchyard.common.tokenizer_loading import load_tokenizer

    w = Workload(args, load_tokenizer(str(model)))
    reqs = prepare(w, args.ctx)
    sizes = [len(r.prompt_ids) for r in reqs.values()]
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    mid = w.shape.mid_system_text
    print(f"model {model} (peers: {peer_model}); shape {args.shape}; main session + "
          f"{args.agents} sub-agents x {args.turns} tool calls (+ a final turn), {len(reqs)} "
          f"requests; system prompt {w.count(w.system)} tokens + {len(w.openai_tools)} tools "
          f"({w.count(json.dumps(w.openai_tools))} tokens as JSON)"
          + (f" + a mid-conversation system message of {w.count(mid)} tokens" if mid else "")
          + f"; prompts {min(sizes)}-{max(sizes)} "
          f"tokens, {sum(r.new for r in reqs.values())} new tokens in all; replies <= "
          f"{args.reply} tokens; switchyard --slots {args.slots} --max-running "
          f"{args.max_running}", flush=True)

    rows, figs, notes, series = [], {}, [], {}
    for server in servers:
        print(f"\n== {server}", flush=True)
        if server == "switchyard":
            extra = ["--kv-disk-budget", args.disk_budget, "--max-running",
                     str(args.max_running), *args.extra.split()]
            if args.background_subagents:
                extra += ["--background-model", SUBAGENT_MODEL]
            with ServerGroup(ours, slots=args.slots, ctx=args.ctx, extra=extra,
                             startup_timeout_s=600) as group:
                try:
                    with TreeMemory(group.proc.pid) as mem:
                        done, wall = run(server, group.url, w, reqs, log)
                finally:
                    keep(args, server, group.log_text())
                label = f"switchyard --slots {args.slots}" + (
                    f" --max-running {args.max_running}" if args.max_running else "") + (
                    " --background-model" if args.background_subagents else "")
                row, figs[server] = summarize(label, done, wall, mem)
                notes += switchyard_detail(group, figs[server]["worst"])
                notes += residency(done, admission_times(group, done), args.turns, args.residency)
        else:
            peer = (mlx_lm_server(peer_model, args.peer_extra.split()) if server == "mlx_lm"
                    else vllm_mlx_server(peer_model, args.ssd_gb, args.peer_extra.split()))
            try:
                with peer:
                    try:
                        with TreeMemory(peer.pgid) as mem:
                            done, wall = run(server, peer.url, w, reqs, log, str(peer_model))
                    finally:
                        keep(args, server, peer.log_text())
                    if server == "vllm_mlx":
                        try:
                            stats = httpx.get(f"{peer.url}/v1/cache/stats", timeout=30).json()
                            notes.append("vllm-mlx /v1/cache/stats: " + json.dumps(
                                stats.get("engine_cache"))[:600])
                        except (httpx.HTTPError, ValueError) as e:
                            notes.append(f"vllm-mlx /v1/cache/stats: {e}")
                text = peer.log_text()
                if server == "vllm_mlx":
                    match_vllm(done, text)
                row, figs[server] = summarize(peer.name, done, wall, mem)
            finally:
                peer.cleanup()
        rows.append(row)
        series[row[0]] = ttft_points(done)

    print("\nTTFT over every request (s); re-read: prompt - cached - new, summed (each server's "
          "own cached count; new: growth over the conversation's previous prompt); prefilled: "
          "prompt - cached; prompt ok: prompt tokens equal to the chat template's rendering "
          "(vllm-mlx writes tool calls and results as text of its own for a template without "
          "tools); RSS / PSS: peak, MiB, summed over the server's process tree")
    print(table(["server", "requests", "wall s", "p50", "p95", "max", "slowest", "re-read",
                 "prefilled", "prompt ok", "RSS", "PSS"], rows))
    for line in notes:
        print(line)
    sy = figs.get("switchyard")
    for peer in ("mlx_lm", "vllm_mlx"):
        if sy and peer in figs:
            p = figs[peer]
            print(f"switchyard / {peer}: p95 {fmt(sy['p95'] / p['p95'], 2)}, max "
                  f"{fmt(sy['max'] / p['max'], 2)}, wall {fmt(sy['wall'] / p['wall'], 2)} "
                  "(targets: p95 < 1, max < 1, wall <= 1)")
    if sy:
        print(f"switchyard re-read tokens: {sy['reread']} (target 0 while the disk budget holds "
              "the working set)")
    if args.plot:
        from bench._plot import plot_ttft

        title = (f"{model.name}: main + {args.agents} sub-agents x {args.turns} tool calls, "
                 f"shape {args.shape}, grow to {args.grow_to}")
        print(f"plot: {plot_ttft(series, Path(args.plot), title)}")
    return 0


def ttft_points(done: list[Done]) -> list[tuple[float, float]]:
    """(seconds after the run's first request, TTFT) per request, in the order sent."""
    t0 = min(d.res.sent for d in done)
    return sorted((d.res.sent - t0, d.res.ttft) for d in done)


def keep(args, server: str, text: str) -> None:
    if args.keep_log:
        Path(args.keep_log).mkdir(parents=True, exist_ok=True)
        (Path(args.keep_log) / f"agent_traffic-{server}.log").write_text(text)


if __name__ == "__main__":
    sys.exit(main())
