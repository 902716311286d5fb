"""One chat turn, whatever the API: prompt planning (render, forced call, stop tokens), then
the request's events turned into output events and a result, and the turn remembered for
prefix-stable rendering of the next request.

`plan_turn` runs in the tokenizer thread; `ChatTurn` runs on the event loop. `TextTurn` is the
same interface for /v1/completions (text only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from switchyard.gateway.errors import APIError
from switchyard.gateway.generation import Generation, Usage
from switchyard.gateway.prompting.history import Rendered, RenderOptions, TurnMemory, render_prompt
from switchyard.gateway.output.harmony import HarmonyParser
from switchyard.gateway.output.parser import Event, Forced, OutputParser, TextDelta
from switchyard.gateway.output.reasoning import ThinkSyntax, prompt_opens_reasoning
from switchyard.gateway.request import structured
from switchyard.gateway.request.model import ChatRequest
from switchyard.gateway.request.scripted import forced_reply, reply_text, scripted_rule
from switchyard.gateway.request.structured import Constraint
from switchyard.gateway.output.call_grammar import UnsupportedCallFormat, call_grammar, token_literals
from switchyard.gateway.output.tools import HARMONY_FAMILY, ToolCall, ToolSyntax, new_call_id, tool_names
from switchyard.common.script import Rule, Script



HARMONY_FINAL = "<|channel|>final<|message|>"
PROMPT_TAIL = 24  # characters of the prompt's end that locate a turn without an opening


@dataclass(frozen=True)
class TurnPlan:
    prompt_ids: list[int]
    rendered: Rendered
    forced: Forced | None = None
    forced_ids: tuple[int, ...] = ()
    extra_stop_ids: tuple[int, ...] = ()
    start_in_reasoning: bool = False
    syntax: ToolSyntax | None = None  # None: the output is not searched for tool calls
    channels: bool = False  # harmony output (gpt-oss): parsed by channel (harmony.py)
    # Structured outputs: the grammar the output must match and the tokens after which it
    # applies (docs/design/requests.md "Structured outputs").
    constraint: Constraint | None = None
    trigger_ids: tuple[int, ...] = ()
    script_rule: int | None = None  # the script's rule that decided the reply (1-based)


def _single_token(tokenizer: Any, text: str) -> tuple[int, ...]:
    if not text:
        return ()
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    return ids if len(ids) == 1 else ()


def _with_trigger(tokenizer: Any, plan: TurnPlan, constraint: Constraint | None) -> TurnPlan:
    if constraint is None:
        return plan
    trigger = tuple(tokenizer.encode(constraint.trigger, add_special_tokens=False)) \
        if constraint.trigger else ()
    return dataclasses.replace(plan, constraint=constraint, trigger_ids=trigger)


def _call_constraint(tokenizer: Any, chat: ChatRequest, syntax: ToolSyntax, mode: str,
                     name: str | None) -> Constraint | None:
    try:
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        grammar = call_grammar(syntax, chat.tools, chat.strict_tools, mode, name,
                               chat.parallel_tool_calls, token_literals(added))
    except UnsupportedCallFormat:
        return None  # a format without a grammar: calls are parsed, not constrained
    return structured.lark(grammar.lark, "tools", trigger=grammar.trigger,
                           what="the grammar of their calls")


def plan_turn(tokenizer: Any, chat: ChatRequest, options: RenderOptions,
              syntax: ToolSyntax, think: ThinkSyntax | None,
              script: Script | None = None) -> TurnPlan:
    """Render the prompt and decide how tool calls are made (runs in the tokenizer thread);
    with a `script` whose rule holds for the request, that rule decides the reply's words."""
    rendered = render_prompt(tokenizer, chat.messages, chat.tools, chat.template_kwargs, options)
    start_in_reasoning = prompt_opens_reasoning(rendered.text_tail, think)
    channels = syntax.family == HARMONY_FAMILY
    scripted = scripted_rule(script, chat)
    if scripted is not None:
        return _scripted_plan(tokenizer, rendered, scripted, syntax, think, start_in_reasoning,
                              channels)
    choice = chat.tool_choice
    answer = chat.constraint
    if answer is not None and start_in_reasoning:  # reasoning stays free until it closes
        answer = dataclasses.replace(answer, trigger=think.end)
    elif answer is not None and channels:  # harmony: the final channel holds the answer
        answer = dataclasses.replace(answer, trigger=HARMONY_FINAL)
    if not chat.tools or choice.mode == "none":
        plan = TurnPlan(rendered.ids, rendered, start_in_reasoning=start_in_reasoning,
                        channels=channels)
        return _with_trigger(tokenizer, plan, answer)
    name = choice.name
    if choice.mode == "required" and len(chat.tools) == 1:
        name = tool_names(chat.tools)[0]
    end_ids = _single_token(tokenizer, syntax.end)
    if choice.mode == "auto":
        stops = end_ids if not chat.parallel_tool_calls else ()
        plan = TurnPlan(rendered.ids, rendered, extra_stop_ids=stops,
                        start_in_reasoning=start_in_reasoning, syntax=syntax,
                        channels=channels)
        # A response format governs the answer; without one, a call the model starts is
        # completed under its schema.
        return _with_trigger(tokenizer, plan, answer or _call_constraint(
            tokenizer, chat, syntax, "auto", None))
    opening = syntax.forced_opening(name)
    text = opening
    if start_in_reasoning:  # close the open think block before the call
        text = think.end + "\n\n" + opening
    forced_ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    forced = Forced(syntax.forced_call_text(opening), name)
    plan = TurnPlan(rendered.ids + list(forced_ids), rendered, forced, forced_ids,
                    extra_stop_ids=end_ids, syntax=syntax, channels=channels)
    return _with_trigger(tokenizer, plan,
                         _call_constraint(tokenizer, chat, syntax, "forced", name))


def _scripted_plan(tokenizer: Any, rendered: Rendered, rule: Rule, syntax: ToolSyntax,
                   think: ThinkSyntax | None, start_in_reasoning: bool,
                   channels: bool) -> TurnPlan:
    """The rule's reply, every token forced; parsed for calls as the model's own output is."""
    text = reply_text(rule, syntax)
    if start_in_reasoning:  # close the open think block first, as a forced call does
        text = think.end + "\n\n" + text
    elif channels and not rule.calls:
        text = HARMONY_FINAL + text
    return TurnPlan(rendered.ids, rendered, start_in_reasoning=start_in_reasoning,
                    syntax=syntax, channels=channels, constraint=forced_reply(tokenizer, text),
                    script_rule=rule.number)


@dataclass(frozen=True)
class TurnResult:
    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" (a cut call is incomplete) | "tool_calls" | ...
    stop_sequence: str | None
    usage: Usage


@dataclass
class TurnUpdate:
    events: list[Event] = field(default_factory=list)
    cancel: bool = False
    result: TurnResult | None = None
    error: APIError | None = None
    has_text: bool = False


class ChatTurn:
    def __init__(self, tokenizer: Any, plan: TurnPlan, chat: ChatRequest, *,
                 skip_ids: tuple[int, ...], think: ThinkSyntax | None,
                 memory: TurnMemory | None, id_prefix: str = "call_",
                 on_result: Callable[["ChatTurn", TurnResult], None] | None = None,
                 show_special: bool = False) -> None:
        self.plan = plan
        self.memory = memory
        self._tokenizer = tokenizer
        self.generation = Generation(tokenizer, prompt_ids=plan.prompt_ids,
                                     stop=chat.options.stop, skip_ids=skip_ids,
                                     show_special=show_special)
        parser_class = HarmonyParser if plan.channels else OutputParser
        self.parser = parser_class(
            think=think, syntax=plan.syntax, tools=chat.tools,
            start_in_reasoning=plan.start_in_reasoning, forced=plan.forced,
            parallel=chat.parallel_tool_calls and plan.forced is None,
            new_id=lambda: new_call_id(id_prefix))
        # The call's end marker, added to the remembered body when it stopped the output; not
        # when it is an end-of-turn token (harmony's <|call|>): the template writes that one.
        self._end_ids = tokenizer.encode(plan.syntax.end, add_special_tokens=False) \
            if plan.syntax is not None and plan.syntax.end else []
        if set(self._end_ids) & set(skip_ids):
            self._end_ids = []
        self.on_result = on_result
        self.result: TurnResult | None = None
        self._start_events = self.parser.start_events()  # before any output is parsed
        self._cut = False  # cancelled by us after the one call allowed

    def start_events(self) -> list[Event]:
        return self._start_events

    def on_event(self, event: Any) -> TurnUpdate:
        update = self.generation.on_event(event)
        out = TurnUpdate(cancel=update.cancel, error=update.error)
        if update.text:
            out.events = self.parser.push(update.text)
            out.has_text = True
            if self.parser.stop_requested:
                out.cancel = self._cut = True
        if update.finish is not None:
            reason = update.finish.reason
            # A call still open at a stop token was closed by it (harmony's <|call|> always).
            closed = (bool(self.plan.extra_stop_ids) or self.plan.channels) \
                and reason == "stop" and self.parser.in_open_call
            out.events += self.parser.finish(closed_by_stop=closed,
                                             truncated=reason == "length")
            if self.parser.calls and not self.parser.truncated_call:
                reason = "tool_calls"  # a call cut by the limit says "length"
            self.result = TurnResult(
                self.parser.content_text, self.parser.reasoning_text, list(self.parser.calls),
                reason, self.generation.matched_stop, update.finish.usage)
            out.result = self.result
            self._remember(update.finish.reason, closed)
            if self.on_result is not None:
                self.on_result(self, self.result)
        return out

    def _remember(self, scheduler_reason: str, closed_by_stop: bool) -> None:
        """Keep the generated tokens for the next turn's rendering, unless what the client got
        is not what was generated (stop string cut, cancelled by the client); a turn we cut
        after its one call keeps the tokens through that call."""
        if self.memory is None or self.result is None or self.generation.stop_matched:
            return
        generated = self.generation.token_ids
        if self._cut:  # cancelled after the one call allowed: the tokens up to its end
            generated = self._through_call_end(generated)
            if generated is None:
                return
        elif scheduler_reason not in ("stop", "length"):
            return
        body = list(self.plan.forced_ids) + generated
        if closed_by_stop and not self._cut:
            body += self._end_ids
        rendered = self.plan.rendered
        # Where the turn starts: after the generation prompt, or (a template without one, such
        # as Mistral's) after the end of the prompt the model saw.
        opening = rendered.opening if rendered.opening else rendered.text_tail[-PROMPT_TAIL:]
        self.memory.remember(assistant_message(self.result), body, opening or None,
                             bool(self.result.reasoning), rendered.prefix, rendered.salt)

    def _through_call_end(self, ids: list[int]) -> list[int] | None:
        """The shortest prefix of `ids` whose text holds the call's end marker (a marker of
        several tokens, such as `</tool_call>` in SmolLM2's vocabulary, stops no generation:
        the parser saw the call end and the turn was cancelled there); None without one."""
        end = self.plan.syntax.end if self.plan.syntax is not None else ""

        def has_end(k: int) -> bool:
            return end in self._tokenizer.decode(ids[:k], skip_special_tokens=False)

        if not end or not has_end(len(ids)):
            return None
        k = len(ids)
        while k > 1 and has_end(k - 1):
            k -= 1
        return ids[:k]

    @property
    def num_malformed(self) -> int:
        return self.parser.num_malformed

    @property
    def num_repaired(self) -> int:
        return self.parser.num_repaired

    @property
    def malformed_texts(self) -> list[str]:
        return self.parser.malformed


def assistant_message(result: TurnResult) -> dict[str, Any]:
    """The turn as a canonical chat message (what a client sends back next time)."""
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in result.tool_calls]
    return message


class TextTurn:
    """A /v1/completions generation: text only, nothing remembered."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: tuple[str, ...],
                 skip_ids: tuple[int, ...], show_special: bool = False) -> None:
        self.generation = Generation(tokenizer, prompt_ids=prompt_ids, stop=stop,
                                     skip_ids=skip_ids, show_special=show_special)
        self.result: TurnResult | None = None
        self.num_malformed = self.num_repaired = 0
        self.malformed_texts: list[str] = []
        self._text: list[str] = []

    def start_events(self) -> list[Event]:
        return []

    def on_event(self, event: Any) -> TurnUpdate:
        update = self.generation.on_event(event)
        out = TurnUpdate(cancel=update.cancel, error=update.error, has_text=bool(update.text))
        if update.text:
            self._text.append(update.text)
            out.events = [TextDelta(update.text)]
        if update.finish is not None:
            self.result = TurnResult("".join(self._text), "", [], update.finish.reason,
                                     self.generation.matched_stop, update.finish.usage)
            out.result = self.result
        return out
