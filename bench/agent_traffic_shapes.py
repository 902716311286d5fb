"""bench/agent_traffic.py's request shapes: what every request carries around a conversation's
own turns (the synthetic shape's tools and system prompt, or Claude Code's recorded first
request, tests/corpus), and the seeded tool output its tool results are made of.

Not a benchmark itself: bench/agent_traffic_workload.py builds the conversations from these.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

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

