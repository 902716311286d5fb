"""Real agent sessions with scripted words (`switchyard serve --script`): the rules each client's
session follows, and what the server's log must show of it.

A random model cannot drive a tool loop, so a script decides what the model says while the
clients run for real: they call their tools (Bash, Read, Edit, exec_command, ...), start their
sub-agents (Claude Code's `Agent`, opencode's `task`, Qwen Code's `agent`) and send the results
back; the server does all the real work (prefill, decode, KV pages, parsing, streaming).

    script = session_script(work)   # the rules, for files in `work` (a.txt ... ; notes.txt)
    ... run the clients ...
    requests = script_requests(lines)                 # the gateway's request.finished lines
    problems = session_problems(requests, SESSIONS["claude-code"], page_size)

Each session is a list of conversations, each the rules its requests follow in order (the
main agent's, then each sub-agent's): the log's `script_rule` ties a request to its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Files the sessions read: name -> number of lines.
FILES = {"a.txt": 3, "b.txt": 4, "c.txt": 5, "d.txt": 6, "e.txt": 7, "f.txt": 8}
NOTES = "status: draft\nowner: ops\n"
# Claude Code's compaction: three files of PART_CHARS characters (about 17K tokens each with the
# terse twin's tokenizer) outgrow a 65,536-token context on the third turn, after Claude Code's
# own ~21K-token prompt; with its oldest round dropped, the summary request fits.
PARTS = ("part1.txt", "part2.txt", "part3.txt")
PART_CHARS = 27_000
STORY = " ".join(["Once upon a time there was a server that kept every page it ever read, "
                  "and every turn paid only for its own new tokens."] * 40)  # ~2.5K tokens: still
# being written when the client stops it
QWEN_MAIN = "You are Qwen Code, a non-interactive CLI agent"
QWEN_SUB = "You are a general-purpose subagent"


@dataclass(frozen=True)
class Rule:
    name: str
    when: dict
    say: str = ""
    calls: tuple[dict, ...] = ()

    def to_json(self) -> dict:
        out: dict = {"when": self.when}
        if self.say:
            out["say"] = self.say
        if self.calls:
            out["calls"] = list(self.calls)
        return out


def _counted(name: str) -> str:
    return f"{name} has {FILES[name]} lines."


def _result_of_wc(name: str) -> str:
    """A tool result that holds `wc -l NAME`'s output line (Bash's plain string, Codex's
    'Output:' chunk, opencode's and Qwen Code's text)."""
    return rf"(?m)^\s*{FILES[name]} {name.replace('.', '[.]')}\s*$"


def rules(work: Path) -> list[Rule]:
    """Every session's rules, most specific first (the first rule that holds replies)."""
    notes = str(work / "notes.txt")
    counted_by_sub = [
        Rule(f"sub.{n}.counted", {"last": _result_of_wc(n)}, say=_counted(n))
        for n in ("a.txt", "b.txt", "c.txt", "d.txt", "f.txt")]
    return [
        # Claude Code: three sub-agents in parallel, each runs Bash; the main agent sums.
        Rule("cc.main.start", {"last": "Use three sub-agents in parallel", "tools": ["Agent"]},
             say="I will start three sub-agents.",
             calls=tuple({"name": "Agent", "arguments": {
                 "description": f"Count {n}", "prompt": f"Count the lines of {n} with wc -l.",
                 "subagent_type": "general-purpose", "run_in_background": False}}
                 for n in ("a.txt", "b.txt", "c.txt"))),
        Rule("cc.main.total", {"last": [_counted("a.txt"), _counted("b.txt"),
                                        _counted("c.txt")]}, say="The total is 12 lines."),
        *counted_by_sub,
        *(Rule(f"cc.sub.{n}.start", {"last": f"Count the lines of {n} with wc -l[.]",
                                     "tools": ["Bash"]},
               calls=({"name": "Bash", "arguments": {"command": f"wc -l {n}",
                                                     "description": f"Count lines of {n}"}},))
          for n in ("a.txt", "b.txt", "c.txt")),
        # Claude Code: read a file, edit it, then a second turn (--continue).
        Rule("cc.edit.done", {"last": "has been updated", "tools": ["Edit"]},
             say="notes.txt now says status: final."),
        Rule("cc.edit.read", {"last": "status: draft", "tools": ["Edit"],
                              "system": "Claude Code"},
             calls=({"name": "Edit", "arguments": {
                 "file_path": notes, "old_string": "status: draft",
                 "new_string": "status: final"}},)),
        Rule("cc.edit.start", {"last": "Mark notes[.]txt final", "tools": ["Read"]},
             calls=({"name": "Read", "arguments": {"file_path": notes}},)),
        Rule("cc.edit.again", {"last": "What does notes[.]txt say now"},
             say="It says status: final, owner: ops."),
        # Claude Code at the context limit: told the prompt is too long, it asks for a summary
        # (dropping its oldest rounds while that is too long too), then goes on from it with
        # its last round kept.
        Rule("cc.compact.summary", {"last": "CRITICAL: Respond with TEXT ONLY"},
             say="Summary: the user asked to see part1.txt, part2.txt and part3.txt, one at a "
                 "time; each was shown with cat."),
        Rule("cc.compact.after", {"last": "Which parts did you show"},
             say="part1.txt, part2.txt and part3.txt."),
        *(rule for n, part in enumerate(PARTS, 1) for rule in (
            Rule(f"cc.{part}.shown", {"last": f"PART{n} END"}, say=f"{part} is shown."),
            Rule(f"cc.{part}.start", {"last": f"Show me {part.replace('.', '[.]')}",
                                      "tools": ["Bash"]},
                 calls=({"name": "Bash", "arguments": {"command": f"cat {part}",
                                                       "description": f"Show {part}"}},)))),
        # A long reply that the client stops (tests/e2e/test_agent_clients.py).
        Rule("story", {"last": "Tell me a long story"}, say=STORY),
        # Codex: an exec_command loop over two turns (exec, then exec resume --last).
        Rule("codex.t1.start", {"last": "Count the lines of e[.]txt with a shell command",
                                "tools": ["exec_command"]},
             calls=({"name": "exec_command", "arguments": {"cmd": "wc -l e.txt"}},)),
        Rule("codex.t1.counted", {"last": r"Output:\s*7 e[.]txt"}, say=_counted("e.txt")),
        Rule("codex.t2.start", {"last": "Now count f[.]txt the same way",
                                "tools": ["exec_command"]},
             calls=({"name": "exec_command", "arguments": {"cmd": "wc -l f.txt"}},)),
        # opencode: a `task` sub-agent runs bash; the main agent reports.
        Rule("oc.main.start", {"last": "Ask a sub-agent to count the lines of d[.]txt",
                               "tools": ["task"]},
             calls=({"name": "task", "arguments": {
                 "description": "Count d.txt", "prompt": "Count the lines of d.txt with bash.",
                 "subagent_type": "general"}},)),
        Rule("oc.main.done", {"last": _counted("d.txt"), "tools": ["task"]},
             say="The sub-agent says d.txt has 6 lines."),
        Rule("oc.sub.start", {"last": "Count the lines of d[.]txt with bash",
                              "tools": ["bash"]},
             calls=({"name": "bash", "arguments": {"command": "wc -l d.txt",
                                                   "description": "Count lines of d.txt"}},)),
        # Qwen Code: read_file, then an `agent` sub-agent that reads another file. The
        # sub-agent has the agent tool too: the system prompts tell them apart.
        Rule("qwen.main.start", {"last": "Read a[.]txt, then ask a sub-agent about b[.]txt",
                                 "system": QWEN_MAIN, "tools": ["read_file", "agent"]},
             calls=({"name": "read_file", "arguments": {"file_path": str(work / "a.txt")}},)),
        Rule("qwen.main.read", {"last": r"\A1\n2\n3\n?\Z", "system": QWEN_MAIN,
                                "tools": ["agent"]},
             calls=({"name": "agent", "arguments": {
                 "description": "Read b.txt", "prompt": "Read b.txt and say its last line.",
                 "subagent_type": "general-purpose", "run_in_background": False}},)),
        # Qwen Code asks the model whether its auto mode may run the sub-agent.
        Rule("qwen.classifier", {"system": "You are a security classifier",
                                 "tools": ["respond_in_schema"]},
             calls=({"name": "respond_in_schema", "arguments": {"shouldBlock": False}},)),
        Rule("qwen.main.done", {"last": "The last line of b[.]txt is 4", "system": QWEN_MAIN},
             say="a.txt counts to 3 and b.txt ends with 4."),
        Rule("qwen.sub.read", {"last": r"\A1\n2\n3\n4\n?\Z", "system": QWEN_SUB},
             say="The last line of b.txt is 4."),
        Rule("qwen.sub.start", {"last": "Read b[.]txt and say its last line",
                                "system": QWEN_SUB, "tools": ["read_file"]},
             calls=({"name": "read_file", "arguments": {"file_path": str(work / "b.txt")}},)),
    ]


def prepare_work(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    for name, n in FILES.items():
        (work / name).write_text("".join(f"{i}\n" for i in range(1, n + 1)))
    (work / "notes.txt").write_text(NOTES)
    words = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta")
    for n, part in enumerate(PARTS, 1):  # varied lines: no two parts tokenize alike
        lines = [" ".join(words[(i * 7 + j * n) % 8] for j in range(12)) for i in
                 range(PART_CHARS // 72)]
        (work / part).write_text("\n".join(lines) + f"\nPART{n} END\n")


def session_script(work: Path) -> dict:
    return {"rules": [r.to_json() for r in rules(work)]}


def rule_numbers(work: Path) -> dict[str, int]:
    """Rule name -> its number in the script (1-based, as the log's `script_rule`)."""
    return {r.name: i for i, r in enumerate(rules(work), 1)}


@dataclass(frozen=True)
class Session:
    """One client session: its turns' prompts, the flags that let it act headless, the text
    its last turn must print, and its conversations (the rules each one's requests follow, in
    order; `siblings`: the conversations started together, as parallel sub-agents)."""

    name: str
    client: str
    prompts: tuple[str, ...]
    flags: tuple[str, ...]
    says: str
    conversations: tuple[tuple[str, ...], ...]
    siblings: tuple[int, ...] = ()
    compacts: bool = False  # outgrows the context: a 400 prompt-too-long is expected


SESSIONS = (
    Session("claude-code-subagents", "claude-code",
            ("Use three sub-agents in parallel to count the lines of a.txt, b.txt and c.txt, "
             "then give the total.",),
            ("--permission-mode", "bypassPermissions"), "The total is 12 lines.",
            (("cc.main.start", "cc.main.total"),
             *((f"cc.sub.{n}.start", f"sub.{n}.counted") for n in ("a.txt", "b.txt", "c.txt"))),
            siblings=(1, 2, 3)),
    Session("claude-code-edit", "claude-code",
            ("Mark notes.txt final.", "What does notes.txt say now?"),
            ("--permission-mode", "bypassPermissions"), "It says status: final, owner: ops.",
            (("cc.edit.start", "cc.edit.read", "cc.edit.done", "cc.edit.again"),)),
    Session("claude-code-compact", "claude-code",
            (*(f"Show me {part}" for part in PARTS), "Which parts did you show?"),
            ("--permission-mode", "bypassPermissions"), "part1.txt, part2.txt and part3.txt.",
            # The third part's result is too long; the summary request fits (without it); the
            # compacted session keeps its last round (the third part) after the summary.
            (("cc.part1.txt.start", "cc.part1.txt.shown", "cc.part2.txt.start",
              "cc.part2.txt.shown", "cc.part3.txt.start"),
             ("cc.compact.summary",),
             ("cc.part3.txt.shown", "cc.compact.after")),
            compacts=True),
    Session("codex-exec", "codex",
            ("Count the lines of e.txt with a shell command.", "Now count f.txt the same way."),
            (), "f.txt has 8 lines.",
            (("codex.t1.start", "codex.t1.counted", "codex.t2.start", "sub.f.txt.counted"),)),
    Session("opencode-task", "opencode", ("Ask a sub-agent to count the lines of d.txt.",),
            (), "The sub-agent says d.txt has 6 lines.",
            (("oc.main.start", "oc.main.done"), ("oc.sub.start", "sub.d.txt.counted"))),
    Session("qwen-code-agent", "qwen-code", ("Read a.txt, then ask a sub-agent about b.txt.",),
            ("--yolo",), "a.txt counts to 3 and b.txt ends with 4.",
            (("qwen.main.start", "qwen.main.read", "qwen.main.done"),
             ("qwen.sub.start", "qwen.sub.read"))),
)


def session_problems(requests: list[dict], session: Session, numbers: dict[str, int],
                     page_size: int) -> list[str]:
    """What the server's log (the session's `request.finished` lines, in order) shows against
    the promises: each conversation's requests follow its rules; every request after a
    conversation's first prefills at most one page beyond its new tokens (what the previous
    request left, its prompt and its reply, is reused); sub-agents started together read
    their shared prefix once (the others copy it)."""
    problems, firsts = [], []
    too_long = [r for r in requests if r.get("error_code") == "context_length_exceeded"]
    if session.compacts != bool(too_long):
        problems.append(f"{len(too_long)} requests were too long for the context")
    requests = [r for r in requests if r.get("status") == 200]
    for conversation in session.conversations:
        chain, start = [], 0
        for name in conversation:
            found = next((i for i in range(start, len(requests))
                          if requests[i].get("script_rule") == numbers[name]), None)
            if found is None:
                problems.append(f"no request followed rule {name}")
                break
            chain.append(requests[found])
            start = found + 1
        if chain:
            firsts.append(chain[0])
        for before, after in zip(chain, chain[1:]):
            held = before["num_prompt_tokens"] + before["num_generated_tokens"]
            new = max(0, after["num_prompt_tokens"] - held)
            prefilled = after["num_prompt_tokens"] - after["num_cached_tokens"]
            if prefilled > new + page_size:
                problems.append(f"rule {numbers_name(numbers, after)}: prefilled {prefilled} "
                                f"tokens for {new} new ({held} held from the request before)")
    siblings = sorted((firsts[i] for i in session.siblings if i < len(firsts)),
                      key=lambda r: r["num_cached_tokens"])
    for copied in siblings[1:]:  # all but the one that read the shared prefix
        if copied["num_cached_tokens"] * 2 < copied["num_prompt_tokens"]:
            problems.append(f"sub-agent {numbers_name(numbers, copied)} read its shared prefix "
                            f"again: {copied['num_cached_tokens']} of "
                            f"{copied['num_prompt_tokens']} tokens cached")
    return problems


def numbers_name(numbers: dict[str, int], request: dict) -> str:
    return next((n for n, i in numbers.items() if i == request.get("script_rule")), "?")
