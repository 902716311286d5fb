"""bench/agent_traffic.py's conversations and their rendering: a main session and its sub-agents'
tool loops (deterministic, `--seed`), each request as Switchyard's Anthropic body and as the
peers' OpenAI chat body, and the token ids all three servers must read.

Not a benchmark itself: bench/agent_traffic.py runs these requests
(tests/unit/test_bench_agent_traffic.py checks the renderings agree).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from bench.agent_traffic_shapes import (MODULES, ROOT, SYSTEM_CORE, VERBS, Text,
                                        claude_code_shape, synthetic_shape)

CLAUDE_MODEL = "claude-sonnet-4-5-20250929"
# --background-subagents: the name the sub-agents ask for (Claude Code's
# CLAUDE_CODE_SUBAGENT_MODEL), which Switchyard serves with --background-model.
SUBAGENT_MODEL = "claude-subagents"


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

