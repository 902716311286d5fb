"""The chat output formats of the model families: how each writes reasoning and tool calls.

One `ChatFormat` per family, all in `FORMATS`: its `ToolSyntax` (where a call starts and ends,
how the arguments are written: `render_call`, the opening a forced call starts from, the parser)
and its reasoning markers. This is the one place that knows a family's call syntax, so a
grammar for constrained decoding can be derived from it (docs/design/requests.md "Chat formats").

The format is detected from the model's own chat template (and vocabulary), as mlx-lm does;
`--chat-format` overrides it. Parsers are mlx-lm's where it has one (`json_tools`,
`qwen3_coder`, `glm47`, `minimax_m2`, `mistral`, `gemma4`); the families it lacks are parsed
here (DeepSeek V3.1, Llama 3 JSON, Gemma 3 `tool_code`) or in harmony.py (gpt-oss).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, replace
from typing import Any

import regex as re
from mlx_lm.tool_parsers import gemma4, glm47, minimax_m2, mistral, pythonic, qwen3_coder

from switchyard.gateway.output.reasoning import ThinkSyntax
from switchyard.gateway.output.tools import HARMONY_FAMILY, HERMES, JSON_FAMILY, ToolSyntax

THINK = ThinkSyntax("<think>", "</think>")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- Qwen: Hermes JSON and Qwen3-Coder XML -----------------------------------------------------


def _render_hermes(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": {_dumps(name)}, "arguments": {_dumps(arguments)}}}\n</tool_call>'


def _xml_value(value: Any) -> str:
    return value if isinstance(value, str) else _dumps(value)


def _render_qwen3_coder(name: str, arguments: dict) -> str:
    params = "".join(f"<parameter={k}>\n{_xml_value(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


QWEN3_CODER = ToolSyntax(
    "qwen3_coder", "<tool_call>", "</tool_call>", qwen3_coder.parse_tool_call,
    opening=lambda n: f"<tool_call>\n<function={n}>\n" if n else "<tool_call>\n<function=",
    render=_render_qwen3_coder, name_after="<function=", name_before=">", arguments="xml")


# --- gpt-oss harmony (parsed by harmony.py; the syntax is described here) ----------------------


def _render_harmony(name: str, arguments: dict) -> str:
    return (f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
            f"{_dumps(arguments)}<|call|>")


def _parse_harmony_arguments(text: str, tools: Any = None) -> Any:
    """The body of a harmony call message: `NAME <|constrain|>json<|message|>{...}` after
    `to=functions.`, or only the JSON arguments when the header was parsed already."""
    name, sep, body = text.partition("<|message|>")
    if not sep:
        raise ValueError("no <|message|> in the call")
    name = name.split("<|", 1)[0].split()[0] if name.strip() else ""
    return {"name": name.strip(), "arguments": json.loads(body.strip() or "{}")}


HARMONY = ToolSyntax(
    HARMONY_FAMILY, "<|channel|>commentary to=functions.", "<|call|>", _parse_harmony_arguments,
    opening=lambda n: (f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
                       if n else "<|channel|>commentary to=functions."),
    render=_render_harmony, name_after="to=functions.", name_before=" ")
# Harmony's framing tokens; kept in the decoded text so harmony.py can see the channels.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>",
                  "<|call|>", "<|return|>")


# --- GLM 4.5 / 4.6 / 4.7 -----------------------------------------------------------------------


def _render_glm(name: str, arguments: dict) -> str:
    args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_xml_value(v)}</arg_value>\n"
                   for k, v in arguments.items())
    return f"<tool_call>{name}\n{args}</tool_call>"


def _parse_glm(text: str, tools: Any = None) -> Any:
    call = glm47.parse_tool_call(text, tools)
    if call.get("name") == "unknown" or "raw" in (call.get("arguments") or {}):
        raise ValueError("not a GLM call")  # glm47's last-resort shape: not a call we accept
    return call


GLM = ToolSyntax("glm", "<tool_call>", "</tool_call>", _parse_glm,
                 opening=lambda n: f"<tool_call>{n}\n" if n else "<tool_call>",
                 render=_render_glm, name_after="", name_before="<arg_key>", arguments="xml")


# --- DeepSeek V3.1 -----------------------------------------------------------------------------

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"(.*?)" + re.escape(DS_SEP) + r"(.*?)"
                      + r"(?:" + re.escape(DS_CALL_END) + r"|$)", re.DOTALL)
_DS_V3_FENCE = re.compile(r"^\s*([^\n]+)\n```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _parse_deepseek(text: str, tools: Any = None) -> Any:
    """`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>`, repeated (V3.1);
    also V3's `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```` form."""
    calls = []
    for head, body in _DS_CALL.findall(text):
        head = head.strip()
        if head == "function" and (fence := _DS_V3_FENCE.match(body)):
            head, body = fence.group(1).strip(), fence.group(2)
        calls.append({"name": head, "arguments": json.loads(body)})
    if not calls:
        raise ValueError("no DeepSeek tool call")
    return calls


def _render_deepseek(name: str, arguments: dict) -> str:
    return (f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{name}{DS_SEP}{_dumps(arguments)}{DS_CALL_END}"
            f"{DS_CALLS_END}")


DEEPSEEK = ToolSyntax(
    "deepseek_v31", DS_CALLS_BEGIN, DS_CALLS_END, _parse_deepseek,
    opening=lambda n: f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{n}{DS_SEP}" if n
    else f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}",
    render=_render_deepseek, name_after=DS_CALL_BEGIN, name_before=DS_SEP)


# --- MiniMax M2 --------------------------------------------------------------------------------


def _render_minimax(name: str, arguments: dict) -> str:
    params = "".join(f'<parameter name="{k}">{_xml_value(v)}</parameter>\n'
                     for k, v in arguments.items())
    return f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>'


MINIMAX = ToolSyntax(
    "minimax_m2", minimax_m2.tool_call_start, minimax_m2.tool_call_end,
    minimax_m2.parse_tool_call,
    opening=lambda n: f'<minimax:tool_call>\n<invoke name="{n}">\n' if n
    else '<minimax:tool_call>\n<invoke name="',
    render=_render_minimax, name_after='<invoke name="', name_before='"', arguments="xml")


# --- Mistral: `[TOOL_CALLS][{json}, ...]` (v3) and `[TOOL_CALLS]name[ARGS]{json}` (v11+) ------

_CALL_ID = re.compile(r"\[CALL_ID\][^\[]*")


def _parse_mistral(text: str, tools: Any = None) -> Any:
    """mlx-lm's parser; `[CALL_ID]id` (v13 templates) is dropped first, and each further call's
    own `[TOOL_CALLS]` (the call runs to the end of the output) too."""
    text = _CALL_ID.sub("", text).replace("[TOOL_CALLS]", "")
    return mistral.parse_tool_call(text.strip(), tools)


MISTRAL_JSON = ToolSyntax(
    "mistral", "[TOOL_CALLS]", "", _parse_mistral,
    opening=lambda n: f'[TOOL_CALLS][{{"name": {_dumps(n)}, "arguments": ' if n
    else '[TOOL_CALLS][{"name": "',
    render=lambda n, a: f'[TOOL_CALLS][{{"name": {_dumps(n)}, "arguments": {_dumps(a)}}}]',
    name_after='"name": "', name_before='"')
MISTRAL_ARGS = ToolSyntax(
    "mistral_args", "[TOOL_CALLS]", "", _parse_mistral,
    opening=lambda n: f"[TOOL_CALLS]{n}[ARGS]" if n else "[TOOL_CALLS]",
    render=lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{_dumps(a)}", name_after="",
    name_before="[")
MISTRAL_THINK = ThinkSyntax("[THINK]", "[/THINK]")


# --- Llama 3.1 / 3.2 / 3.3 JSON ----------------------------------------------------------------


def _parse_llama3(text: str, tools: Any = None) -> Any:
    """`{"name": ..., "parameters": {...}}`, several separated by `;` (the whole output)."""
    decoder = json.JSONDecoder()
    calls, pos, text = [], 0, text.strip()
    while pos < len(text):
        value, pos = decoder.raw_decode(text, pos)
        if not isinstance(value, dict) or "name" not in value:
            raise ValueError("not a Llama 3 call")
        calls.append({"name": value["name"],
                      "arguments": value.get("parameters", value.get("arguments"))})
        rest = text[pos:].lstrip()
        if rest and not rest.startswith(";"):
            raise ValueError("text after a Llama 3 call")
        pos = len(text) - len(rest.lstrip(";").lstrip())
    return calls


LLAMA3 = ToolSyntax(
    "llama3_json", "{", "", _parse_llama3,
    opening=lambda n: f'{{"name": {_dumps(n)}, "parameters": ' if n else '{"name": "',
    render=lambda n, a: f'{{"name": {_dumps(n)}, "parameters": {_dumps(a)}}}',
    name_after='"name": "', name_before='"',
    keep_start=True, only_at_start=True, alt_starts=("<|python_tag|>",))


# --- Gemma 3 (```tool_code) and Gemma 4 (<|tool_call>) -----------------------------------------


def _parse_gemma3(text: str, tools: Any = None) -> Any:
    """Python calls with keyword arguments, one statement each, inside the fence."""
    body = text.strip()
    tree = ast.parse(body, mode="exec")
    if not tree.body or not all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                                for s in tree.body):
        raise ValueError("not tool_code calls")
    segments = [ast.get_source_segment(body, s.value) for s in tree.body]
    return pythonic.parse_tool_call("[" + ", ".join(segments) + "]", tools)


def _render_gemma3(name: str, arguments: dict) -> str:
    # JSON literals as values: mlx-lm's pythonic parser reads true/false/null too.
    args = ", ".join(f"{k}={_dumps(v)}" for k, v in arguments.items())
    return f"```tool_code\n{name}({args})\n```"


GEMMA3 = ToolSyntax(
    "gemma3", "```tool_code", "```", _parse_gemma3,
    opening=lambda n: f"```tool_code\n{n}(" if n else "```tool_code\n",
    render=_render_gemma3, name_after="", name_before="(", arguments="python")

_GEMMA4_STRING = '<|"|>'


def _gemma4_value(value: Any) -> str:
    if isinstance(value, str):
        return f"{_GEMMA4_STRING}{value}{_GEMMA4_STRING}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma4_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma4_value(v) for v in value) + "]"
    return _dumps(value)


GEMMA4 = ToolSyntax(
    "gemma4", gemma4.tool_call_start, gemma4.tool_call_end, gemma4.parse_tool_call,
    opening=lambda n: f"<|tool_call>call:{n}{{" if n else "<|tool_call>call:",
    render=lambda n, a: f"<|tool_call>call:{n}{_gemma4_value(a)}<tool_call|>",
    name_after="call:", name_before="{", arguments="gemma4")
GEMMA4_THINK = ThinkSyntax("<|channel>thought", "<channel|>")


# --- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatFormat:
    name: str
    tools: ToolSyntax
    think: ThinkSyntax | None = None
    channels: bool = False  # harmony: reasoning, text and calls are channels (harmony.py)
    special: tuple[str, ...] = ()  # further tokens of the syntax

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker string of the format: its tokens are kept when decoding."""
        out = [self.tools.start, self.tools.end, *self.tools.alt_starts, *self.special]
        if self.think is not None:
            out += [self.think.start, self.think.end]
        return tuple(m for m in out if m)


FORMATS: dict[str, ChatFormat] = {f.name: f for f in (
    ChatFormat("hermes", HERMES, THINK),
    ChatFormat("qwen3_coder", QWEN3_CODER, THINK),
    ChatFormat("harmony", HARMONY, None, channels=True, special=HARMONY_TOKENS),
    ChatFormat("glm", GLM, THINK, special=("<arg_key>", "</arg_key>", "<arg_value>",
                                           "</arg_value>")),
    ChatFormat("deepseek_v31", DEEPSEEK, THINK, special=(DS_CALL_BEGIN, DS_CALL_END, DS_SEP)),
    ChatFormat("minimax_m2", MINIMAX, THINK),
    ChatFormat("mistral", MISTRAL_JSON, MISTRAL_THINK, special=("[CALL_ID]",)),
    ChatFormat("mistral_args", MISTRAL_ARGS, MISTRAL_THINK, special=("[ARGS]", "[CALL_ID]")),
    ChatFormat("llama3_json", LLAMA3, None),
    ChatFormat("gemma3", GEMMA3, None),
    ChatFormat("gemma4", GEMMA4, GEMMA4_THINK, special=(_GEMMA4_STRING,)),
)}

# (what the chat template contains, format): the first match wins. Templates of the families
# mlx-lm knows use its markers; the order puts the more specific markers first.
_TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<|channel|>", "<|message|>"), "harmony"),
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<arg_key>",), "glm"),
    ((DS_CALL_BEGIN,), "deepseek_v31"),
    (("[TOOL_CALLS]", "[ARGS]"), "mistral_args"),
    (("[TOOL_CALLS]",), "mistral"),
    (("```tool_code",), "gemma3"),
    (("<tool_call>\\n<function=",), "qwen3_coder"),
    (("<tool_call>\n<function=",), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("<|start_header_id|>", '"parameters"'), "llama3_json"),
    (("<|python_tag|>",), "llama3_json"),
)


# mlx-lm's parser modules (set by tokenizer_config.json's `tool_parser_type`, or inferred) whose
# family is in FORMATS; others (kimi_k2, pythonic, ...) are used with their markers only.
_MLX_MODULES = {JSON_FAMILY: "hermes", "qwen3_coder": "qwen3_coder", "glm47": "glm",
                "laguna": "glm", "minimax_m2": "minimax_m2", "mistral": "mistral",
                "gemma4": "gemma4"}

# Tokens inside the calls of those other families, which the decoder must keep.
_MLX_INNER_TOKENS = {
    "kimi_k2": ("<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"),
    "kimi_k3": ("<|open|>", "<|close|>", "<|sep|>"),
}


def detect_format(tokenizer: Any, override: str = "auto") -> ChatFormat:
    """The family's format: `override` when not "auto", else from the chat template; a template
    that matches none gets mlx-lm's inferred parser, if any, else Hermes JSON."""
    think = _vocab_think(tokenizer)
    if override and override != "auto":
        if override not in FORMATS:
            raise ValueError(f"unknown chat format {override!r}; known: auto, "
                             f"{', '.join(FORMATS)}")
        return _with_think(FORMATS[override], think)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default") or next(iter(template.values()), None)
    if isinstance(template, str):
        for needles, name in _TEMPLATE_MARKERS:
            if all(n in template for n in needles):
                return _with_think(FORMATS[name], think)
    parse = getattr(tokenizer, "tool_parser", None)
    start = getattr(tokenizer, "tool_call_start", None)
    end = getattr(tokenizer, "tool_call_end", None)
    if parse is not None and start and end is not None:
        family = getattr(parse, "__module__", "").rsplit(".", 1)[-1] or "custom"
        if family in _MLX_MODULES:
            return _with_think(FORMATS[_MLX_MODULES[family]], think)
        return ChatFormat(family, ToolSyntax(family, start, end, parse), think,
                          special=_MLX_INNER_TOKENS.get(family, ()))
    return _with_think(FORMATS["hermes"], think)


def _vocab_think(tokenizer: Any) -> ThinkSyntax | None:
    """Reasoning markers as mlx-lm infers them from the vocabulary, plus Mistral's [THINK]."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str) and start and end:
        return ThinkSyntax(start, end)
    vocab = _vocab(tokenizer)
    if MISTRAL_THINK.start in vocab and MISTRAL_THINK.end in vocab:
        return MISTRAL_THINK
    return None


def _with_think(fmt: ChatFormat, think: ThinkSyntax | None) -> ChatFormat:
    """The format's reasoning markers when the vocabulary has them (Qwen3 has <think>,
    Qwen2.5 does not); a format without reasoning (harmony, Llama 3) keeps none."""
    if fmt.channels or fmt.think is None:
        return fmt
    return replace(fmt, think=think if think == fmt.think else None)


def _vocab(tokenizer: Any) -> dict[str, int]:
    try:
        return tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary API
        return {}


def token_texts(tokenizer: Any, ids: tuple[int, ...]) -> tuple[str, ...]:
    """Each token's text, special or not (the stop tokens a template writes after a turn)."""
    texts = (tokenizer.decode([i], skip_special_tokens=False) for i in ids)
    return tuple(t for t in texts if t)


def hidden_special_ids(tokenizer: Any, fmt: ChatFormat) -> tuple[int, ...] | None:
    """Special tokens to drop from the output text: all but those the format's syntax uses
    (harmony's channels, Mistral's [TOOL_CALLS]), which detokenizing must keep. None when the
    tokenizer does not list its added tokens: then special tokens are skipped as before."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict):
        return None
    markers = fmt.markers
    return tuple(sorted(i for i, token in added.items()
                        if getattr(token, "special", False)
                        and not any(getattr(token, "content", str(token)) in m
                                    for m in markers)))
