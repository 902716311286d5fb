"""The model families' chat formats: detection from the chat template, recorded model outputs
parsed into reasoning, text and tool calls at every chunk cut, and prefix-stable replay
(render -> generate -> parse -> re-render gives back exactly the tokens in the KV).

The tokenizers and templates are the project's own, in each family's published format
(fixtures/chat_formats.py, fixtures/chat_templates/); no model runs here.
"""

import json
import random
from types import SimpleNamespace

import pytest

from fixtures.chat_formats import FAMILIES, write_tokenizer
from switchyard.gateway.request.model import ChatRequest, Options, ToolChoice
from switchyard.gateway.output.formats import FORMATS, detect_format, hidden_special_ids, token_texts
from switchyard.gateway.output.harmony import HarmonyParser
from switchyard.gateway.output.parser import (Forced, OutputParser, ReasoningDelta, TextDelta, ToolCallDone,
                                   ToolCallStart)
from switchyard.gateway.output.tools import parse_calls, repair_forced
from switchyard.gateway.request.tools import parse_openai_tools
from switchyard.gateway.prompting.history import RenderOptions, TurnMemory
from switchyard.gateway.prompting.tool_text import text_syntax
from switchyard.gateway.turn import ChatTurn, assistant_message, plan_turn
from switchyard.proto.gateway_scheduler import RequestFinished, TokensGenerated
from switchyard.common.settings import CHAT_FORMATS, Settings, SettingsError

TOOLS = parse_openai_tools([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}])
PARIS = ("get_weather", {"city": "Paris", "days": 2})
TIME = ("get_time", {})
FAMILY_FORMAT = {"chatml": "hermes", "qwen3": "hermes", "qwen3_coder": "qwen3_coder", "gpt_oss": "harmony",
                 "glm": "glm", "deepseek_v31": "deepseek_v31", "minimax_m2": "minimax_m2",
                 "mistral": "mistral", "mistral_args": "mistral_args", "llama3": "llama3_json",
                 "gemma3": "gemma3", "gemma4": "gemma4"}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from switchyard.common.tokenizer_loading import load_tokenizer

    root = tmp_path_factory.mktemp("families")
    return {family: load_tokenizer(str(write_tokenizer(root / family, family)))
            for family in FAMILIES}


# --- the registry ------------------------------------------------------------------------------


def test_settings_list_every_format():
    assert set(CHAT_FORMATS) == {"auto", *FORMATS}
    with pytest.raises(SettingsError, match="--chat-format"):
        Settings(chat_format="nope").validate()
    assert Settings(chat_format="harmony").validate().chat_format == "harmony"


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_rendered_calls_parse_back_and_forced_openings_start_them(name):
    syntax = FORMATS[name].tools
    args = {"city": "Paris \"Île\" 🦜", "days": 2, "flags": {"metric": True}}
    text = syntax.render("get_weather", args)
    assert text.startswith(syntax.forced_opening("get_weather"))
    assert text.startswith(syntax.forced_opening(None))
    assert text.startswith(syntax.start)
    inner = text[len(syntax.start):] if not syntax.keep_start else text
    if syntax.end:
        assert inner.endswith(syntax.end)
        inner = inner[:-len(syntax.end)]
    tools = parse_openai_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "flags": {"type": "object"}}}}}])
    calls = parse_calls(syntax, inner, tools)
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", args)]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_json_arguments_sit_between_opening_and_closing(name):
    """What a grammar needs: for "json" formats a call is opening + JSON object + closing."""
    syntax = FORMATS[name].tools
    args = {"city": "Paris", "days": [1, 2]}
    if syntax.arguments == "json":
        assert syntax.render("get_weather", args) == syntax.forced_opening("get_weather") + \
            json.dumps(args, ensure_ascii=False) + syntax.closing("get_weather")
    else:
        assert syntax.arguments in ("xml", "python", "gemma4")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_format_is_detected_from_the_chat_template(tokenizers, family):
    fmt = detect_format(tokenizers[family])
    assert fmt.name == FAMILY_FORMAT[family]


def test_override_and_unknown_names(tokenizers):
    assert detect_format(tokenizers["qwen3"], "qwen3_coder").name == "qwen3_coder"
    with pytest.raises(ValueError, match="unknown chat format"):
        detect_format(tokenizers["qwen3"], "nope")
    # No template and no mlx-lm parser: Hermes JSON.
    assert detect_format(SimpleNamespace(chat_template=None)).name == "hermes"
    # A family only mlx-lm knows: its parser and markers, and the tokens inside its calls kept.
    from mlx_lm.tool_parsers import kimi_k2
    kimi = detect_format(SimpleNamespace(
        chat_template=None, tool_parser=kimi_k2.parse_tool_call,
        tool_call_start=kimi_k2.tool_call_start, tool_call_end=kimi_k2.tool_call_end))
    assert kimi.name == "kimi_k2" and "<|tool_call_argument_begin|>" in kimi.markers


def test_syntax_tokens_survive_detokenizing(tokenizers):
    """Special tokens that are part of a format's syntax are decoded as text; others are not."""
    for family, kept, dropped in [("gpt_oss", "<|channel|>", "<|startoftext|>"),
                                  ("mistral_args", "[TOOL_CALLS]", "[INST]"),
                                  ("llama3", "<|python_tag|>", "<|start_header_id|>"),
                                  ("gemma4", "<|tool_call>", "<|turn>")]:
        tok = tokenizers[family]
        hidden = set(hidden_special_ids(tok, detect_format(tok)))
        vocab = tok.get_vocab()
        assert vocab[kept] not in hidden and vocab[dropped] in hidden, family
    assert hidden_special_ids(SimpleNamespace(), FORMATS["hermes"]) is None


# --- recorded outputs, parsed at every cut -----------------------------------------------------

# (format, prompt opens reasoning, output text as decoded, reasoning, text, calls)
RECORDED = {
    "qwen3-thinking": ("hermes", False,
                       "<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n"
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                       '"days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                       '"arguments": {}}\n</tool_call>',
                       "The user wants the weather.", "Let me check.", [PARIS, TIME]),
    "qwen3-no-thinking": ("hermes", False, "It is sunny in Paris.", "",
                          "It is sunny in Paris.", []),
    "qwen3-thinking-only": ("hermes", True, "Short plan.\n</think>\n\nDone.", "Short plan.",
                            "Done.", []),
    "qwen3-coder": ("qwen3_coder", False,
                    "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n"
                    "</tool_call>", "", "I'll look it up.", [PARIS]),
    "gpt-oss-call": ("harmony", False,
                     "<|channel|>analysis<|message|>Need the weather for Paris.<|end|>"
                     "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                     '<|constrain|>json<|message|>{"city": "Paris", "days": 2}',
                     "Need the weather for Paris.", "", [PARIS]),
    "gpt-oss-recipient-first": ("harmony", False,
                                "<|channel|>analysis<|message|>Time.<|end|>"
                                "<|start|>assistant to=functions.get_time<|channel|>commentary "
                                "json<|message|>{}", "Time.", "", [TIME]),
    "gpt-oss-final": ("harmony", False,
                      "<|channel|>analysis<|message|>Easy one.<|end|><|start|>assistant"
                      "<|channel|>final<|message|>It is <b>sunny</b>.", "Easy one.",
                      "It is <b>sunny</b>.", []),
    "gpt-oss-preamble": ("harmony", False,
                         "<|channel|>commentary<|message|>Checking now.<|end|><|start|>"
                         "assistant<|channel|>commentary to=functions.get_time <|constrain|>"
                         "json<|message|>{}", "", "Checking now.", [TIME]),
    "gpt-oss-preamble-and-final": ("harmony", False,
                                   "<|channel|>commentary<|message|>Checking now.<|end|>"
                                   "<|start|>assistant<|channel|>final<|message|>It is sunny.",
                                   "", "Checking now.\n\nIt is sunny.", []),
    "glm-4.5": ("glm", False,
                "\n<think>The user wants the weather.</think>\nLet me check.\n"
                "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
                "The user wants the weather.", "Let me check.", [PARIS]),
    "glm-4.7": ("glm", False,
                "<think>Weather.</think><tool_call>get_weather<arg_key>city</arg_key>"
                "<arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>2</arg_value>"
                "</tool_call><tool_call>get_time</tool_call>", "Weather.", "", [PARIS, TIME]),
    "deepseek-v3.1-thinking": ("deepseek_v31", True,
                               "The user wants the weather.</think>Let me check."
                               "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                               '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁call▁begin｜>'
                               "get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
                               "The user wants the weather.", "Let me check.", [PARIS, TIME]),
    "minimax-m2": ("minimax_m2", True,
                   "The user wants the weather.\n</think>\n\nLet me check.\n<minimax:tool_call>\n"
                   '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   '<parameter name="days">2</parameter>\n</invoke>\n</minimax:tool_call>',
                   "The user wants the weather.", "Let me check.", [PARIS]),
    "mistral-v3": ("mistral", False,
                   '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                   '"days": 2}, "id": "a1b2c3d4e"}, {"name": "get_time", "arguments": {}}]',
                   "", "", [PARIS, TIME]),
    "magistral": ("mistral_args", False,
                  '[THINK]The user wants the weather.[/THINK]Let me check.[TOOL_CALLS]get_weather'
                  '[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[CALL_ID]x1y2z3[ARGS]{}',
                  "The user wants the weather.", "Let me check.", [PARIS, TIME]),
    "llama3": ("llama3_json", False,
               '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", "",
               [PARIS]),
    "llama3-python-tag": ("llama3_json", False,
                          '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                          '"days": 2}}; {"name": "get_time", "parameters": {}}', "", "",
                          [PARIS, TIME]),
    "llama3-text": ("llama3_json", False, "Use {curly} braces.", "", "Use {curly} braces.", []),
    "gemma3": ("gemma3", False,
               'Checking.\n```tool_code\nget_weather(city="Paris", days=2)\nget_time()\n```', "",
               "Checking.", [PARIS, TIME]),
    "gemma4": ("gemma4", False,
               "<|channel>thought\nThe user wants the weather.<channel|>Let me check."
               '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>',
               "The user wants the weather.", "Let me check.", [PARIS]),
}


def make_parser(fmt_name, start_in_reasoning=False, **kw):
    fmt = FORMATS[fmt_name]
    ids = iter(f"call_{i}" for i in range(100))
    cls = HarmonyParser if fmt.channels else OutputParser
    return cls(think=fmt.think, syntax=fmt.tools, tools=TOOLS,
               start_in_reasoning=start_in_reasoning, new_id=lambda: next(ids), **kw)


def run(parser, chunks):
    events = parser.start_events()
    for chunk in chunks:
        events += parser.push(chunk)
    return events + parser.finish(closed_by_stop=True)


def outcome(events):
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [(e.call.name, json.loads(e.call.arguments)) for e in events
             if isinstance(e, ToolCallDone)]
    starts = [e.index for e in events if isinstance(e, ToolCallStart)]
    assert starts == list(range(len(calls)))
    return reasoning, text, calls


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_recorded_output_parses_the_same_at_every_cut(case):
    fmt, opens, text, reasoning, content, calls = RECORDED[case]
    expected = (reasoning, content, [tuple(c) for c in calls])
    assert outcome(run(make_parser(fmt, opens), [text])) == expected
    for i in range(len(text) + 1):
        assert outcome(run(make_parser(fmt, opens), [text[:i], text[i:]])) == expected, i
    rng = random.Random(case)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), 12)))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [None])]
        assert outcome(run(make_parser(fmt, opens), chunks)) == expected


def test_harmony_forced_call_is_announced_and_parsed():
    syntax = FORMATS["harmony"].tools
    opening = syntax.forced_opening("get_weather")
    parser = make_parser("harmony", forced=Forced(syntax.forced_call_text(opening), "get_weather"),
                         parallel=False)
    events = parser.start_events()
    assert [e.name for e in events] == ["get_weather"]
    events += parser.push('{"city": "Paris", "days": 2}') + parser.finish(closed_by_stop=True)
    assert outcome(events)[2] == [PARIS] and parser.num_repaired == 0
    # `required`: the model writes the name; junk arguments are repaired to {}.
    parser = make_parser("harmony", forced=Forced("", None))
    events = parser.push("get_ti <|constrain|>json<|message|>{oops") + parser.finish()
    assert [(e.call.name, e.call.arguments) for e in events if isinstance(e, ToolCallDone)] == [
        ("get_time", "{}")]
    assert parser.num_repaired == 1


@pytest.mark.parametrize("fmt", ["glm", "deepseek_v31", "minimax_m2", "mistral_args",
                                 "llama3_json", "gemma3", "gemma4", "qwen3_coder"])
def test_forced_calls_cut_short_are_repaired(fmt):
    syntax = FORMATS[fmt].tools
    text = syntax.forced_call_text(syntax.forced_opening(None)) + "get_ti"
    (name, arguments), repaired = repair_forced(syntax, text, None, TOOLS)
    assert (name, arguments, repaired) == ("get_time", "{}", True)


# --- prefix-stable replay per family -----------------------------------------------------------

# What the model generates on the first turn (decoded text; the stop token is not part of it).
REPLAY = {
    "qwen3": RECORDED["qwen3-thinking"][2],
    "qwen3_coder": RECORDED["qwen3-coder"][2],
    "gpt_oss": RECORDED["gpt-oss-call"][2],
    "glm": RECORDED["glm-4.5"][2],
    "deepseek_v31": RECORDED["deepseek-v3.1-thinking"][2],
    "minimax_m2": RECORDED["minimax-m2"][2],
    "mistral": RECORDED["mistral-v3"][2],
    "mistral_args": RECORDED["magistral"][2],
    "llama3": RECORDED["llama3"][2],
    "gemma3": RECORDED["gemma3"][2],
    "gemma4": RECORDED["gemma4"][2],
}
REPLAY["chatml"] = REPLAY["qwen3-no-thinking"] = ('<tool_call>\n{"name": "get_weather", "arguments": '
                               '{"city": "Paris", "days": 2}}\n</tool_call>')
TEMPLATE_KWARGS = {"deepseek_v31": {"thinking": True},
                   "qwen3-no-thinking": {"enable_thinking": False}}


def chat(messages, family, choice=None):
    return ChatRequest(messages=messages, options=Options(), tools=TOOLS,
                       tool_choice=choice or ToolChoice("auto"),
                       template_kwargs=TEMPLATE_KWARGS.get(family, {}))


def generate(tok, fmt, plan, request, memory, body, hidden):
    """The gateway's side of a turn: the worker's tokens in, parsed result out, remembered."""
    stop_ids = tuple(tok.eos_token_ids)
    turn = ChatTurn(tok, plan, request, skip_ids=stop_ids + hidden, show_special=True,
                    think=fmt.think, memory=memory)
    turn.on_event(TokensGenerated("r", tuple(body)))
    update = turn.on_event(RequestFinished("r", "stop", len(plan.prompt_ids), 0, len(body)))
    return update.result


# The answer after the tool result (the third request resends both turns).
ANSWER = {"gpt_oss": "<|channel|>analysis<|message|>Got it.<|end|><|start|>assistant"
                     "<|channel|>final<|message|>It is 18C in Paris.",
          "minimax_m2": "Got it.\n</think>\n\nIt is 18C in Paris."}


@pytest.mark.parametrize("case", sorted(REPLAY))
def test_replay_gives_back_the_tokens_in_the_kv(tokenizers, case):
    """A call, its result, an answer, a new question: each request's prompt starts with exactly
    what the server held after the previous one (its prompt + the generated tokens)."""
    family = case.split("-")[0]
    tok = tokenizers[family]
    fmt = detect_format(tok)
    hidden = hidden_special_ids(tok, fmt)
    memory = TurnMemory()
    options = RenderOptions(memory=memory, think_start=fmt.think.start if fmt.think else None,
                            turn_ends=token_texts(tok, tuple(tok.eos_token_ids)),
                            tools_as_text=text_syntax(tok, fmt.tools))
    history = [{"role": "system", "content": "Be terse."},
               {"role": "user", "content": "Weather in Paris?"}]
    outputs = [REPLAY[case], ANSWER.get(family, "It is 18C in Paris.")]
    for n, output in enumerate(outputs):
        plan = plan_turn(tok, chat(history, case), options, fmt.tools, fmt.think)
        body = tok.encode(output, add_special_tokens=False)
        result = generate(tok, fmt, plan, chat(history, case), memory, body, hidden)
        kv = plan.prompt_ids + body  # what the worker holds: prompt + generated, not the stop
        returned = assistant_message(result)
        if n == 0:
            assert [c.name for c in result.tool_calls][:1] == ["get_weather"], result
            if family == "llama3":  # Llama 3's template takes one call a turn (as published)
                returned["tool_calls"] = returned["tool_calls"][:1]
            history += [returned] + [{"role": "tool", "tool_call_id": c["id"], "content": "18C"}
                                     for c in returned["tool_calls"]]
        else:
            assert result.content == "It is 18C in Paris." and not result.tool_calls, result
            history += [returned, {"role": "user", "content": "And tomorrow?"}]
        following = plan_turn(tok, chat(history, case), options, fmt.tools, fmt.think)
        if family == "mistral" and n == 1:
            # Mistral v3's published template lists the tools before the *last* user message,
            # so a new question moves them: the prompt changes right after <s> whatever is
            # spliced, and no remembered turn followed these tokens (turns are keyed by the
            # tokens before them): the turns render from their messages, as without memory.
            assert following.rendered.num_spliced == 0
            plain = plan_turn(tok, chat(history, case), RenderOptions(
                prefix_stable=False, tools_as_text=options.tools_as_text), fmt.tools, fmt.think)
            assert following.prompt_ids == plain.prompt_ids
            continue
        assert following.rendered.num_spliced == n + 1
        assert following.prompt_ids[:len(kv)] == kv
        # After the spliced turn comes exactly what the template writes after that turn (its
        # end of turn, once, then the next messages), as in the plain rendering.
        rest = tok.decode(following.prompt_ids[len(kv):], skip_special_tokens=False)
        plain = plan_turn(tok, chat(history, case), RenderOptions(
            prefix_stable=False, tools_as_text=options.tools_as_text), fmt.tools, fmt.think)
        assert ("18C" if n == 0 else "And tomorrow?") in rest
        assert tok.decode(plain.prompt_ids, skip_special_tokens=False).endswith(rest)


def test_client_reasoning_reaches_the_gpt_oss_template(tokenizers):
    """A turn the server does not remember: its reasoning is rendered on the analysis channel."""
    tok = tokenizers["gpt_oss"]
    fmt = detect_format(tok)
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}}
    history = [{"role": "user", "content": "Time?"},
               {"role": "assistant", "content": None, "reasoning_content": "Need the clock.",
                "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    plan = plan_turn(tok, chat(history, "gpt_oss"), RenderOptions(), fmt.tools, fmt.think)
    assert "<|channel|>analysis<|message|>Need the clock.<|end|>" in tok.decode(
        plan.prompt_ids, skip_special_tokens=False)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_any_text_parses_the_same_however_it_is_chunked(name):
    """Random text made of the format's markers and call fragments: the events are the same for
    one chunk and for random chunks (markers are held back until decided)."""
    fmt = FORMATS[name]
    pieces = [*fmt.markers, *(fmt.think and (fmt.think.start, fmt.think.end) or ()),
              fmt.tools.render("get_time", {}), fmt.tools.forced_opening("get_weather"),
              "a", " ", "\n", "{", "}", '"', "x y", "<", "|", ">"]
    rng = random.Random(name)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        whole = outcome(run(make_parser(name), [text]))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [None])]
        assert outcome(run(make_parser(name), chunks)) == whole, (text, chunks)


def test_structured_answer_of_gpt_oss_starts_at_the_final_channel(tokenizers):
    """A response format constrains harmony's final channel; analysis stays free."""
    from switchyard.gateway.request import structured

    tok = tokenizers["gpt_oss"]
    fmt = detect_format(tok)
    request = ChatRequest(messages=[{"role": "user", "content": "JSON please"}],
                          options=Options(), constraint=structured.json_schema(
                              {"type": "object"}, "response_format"))
    plan = plan_turn(tok, request, RenderOptions(), fmt.tools, fmt.think)
    assert plan.constraint is not None and plan.trigger_ids == tuple(
        tok.encode("<|channel|>final<|message|>", add_special_tokens=False))


def test_a_call_cut_after_its_multi_token_end_is_remembered_through_that_end(tokenizers):
    """SmolLM2's vocabulary has no `</tool_call>` token: a forced call is not ended by a stop
    token but cancelled when the parser sees its end. The tokens through that end are what
    the next request gets back (the KV holds them); what came after them is not."""
    tok = tokenizers["chatml"]
    fmt = detect_format(tok)
    memory = TurnMemory()
    options = RenderOptions(memory=memory, turn_ends=token_texts(tok, tuple(tok.eos_token_ids)),
                            tools_as_text=text_syntax(tok, fmt.tools))
    history = [{"role": "user", "content": "Weather in Paris?"}]
    forced = ToolChoice("function", "get_weather")
    plan = plan_turn(tok, chat(history, "chatml", forced), options, fmt.tools, fmt.think)
    call_rest = '{"city": "Paris", "days": 2}}\n</tool_call>'
    body = tok.encode(call_rest, add_special_tokens=False)
    assert len(tok.encode("</tool_call>", add_special_tokens=False)) > 1
    turn = ChatTurn(tok, plan, chat(history, "chatml", forced), skip_ids=tuple(tok.eos_token_ids),
                    think=fmt.think, memory=memory)
    update = turn.on_event(TokensGenerated("r", tuple(body)))
    assert update.cancel  # the one call is complete: the gateway cancels the rest
    late = tok.encode(" more", add_special_tokens=False)  # generated before the cancel landed
    turn.on_event(TokensGenerated("r", tuple(late)))
    result = turn.on_event(RequestFinished("r", "cancelled", len(plan.prompt_ids), 0,
                                           len(body) + len(late))).result
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [PARIS]
    history += [assistant_message(result), {"role": "tool", "content": "18C",
                                            "tool_call_id": result.tool_calls[0].id}]
    following = plan_turn(tok, chat(history, "chatml"), options, fmt.tools, fmt.think)
    assert following.rendered.num_spliced == 1
    assert following.prompt_ids[:len(plan.prompt_ids) + len(body)] == plan.prompt_ids + body
