"""Prefix-stable rendering: a remembered assistant turn renders as the exact tokens the model
generated, so the next prompt starts with the previous prompt + generated tokens.

Uses the tiny model's tokenizer and chat template through transformers (no MLX), plus
templates of other shapes: Qwen3's (empty think block in the last assistant turn, reasoning
dropped from earlier turns) and a thinking model's (`<think>\\n` in the generation prompt).
"""

import json
import random

import pytest

from switchyard.gateway.errors import APIError
from switchyard.gateway.prompting.history import RenderOptions, TurnMemory, render_prompt
from switchyard.gateway.prompting.turn_keys import message_key

CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Weather in Paris?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]

# Qwen3's assistant rendering, reduced: the last assistant turn after the last user message gets
# a (possibly empty) think block, earlier turns lose their reasoning.
QWEN3_LIKE = r"""{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}{%- set ns.last_query_index = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{%- set content = message.content or '' %}
{%- if loop.index0 > ns.last_query_index and (loop.last or message.reasoning_content) %}
{{- '<|im_start|>assistant\n<think>\n' + (message.reasoning_content or '') + '\n</think>\n\n' + content }}
{%- else %}{{- '<|im_start|>assistant\n' + content }}{%- endif %}
{%- for tc in message.tool_calls or [] %}{{- '\n<tool_call>\n{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + '}\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

# A thinking-only model: the generation prompt opens the think block.
THINKING = QWEN3_LIKE[:QWEN3_LIKE.rindex("{%- if add_generation_prompt")] + \
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_tokenizer):
    return tiny_hf_tokenizer


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def odd_body(tokenizer, text, seed=0):
    """Tokens that decode to `text` but are not how the tokenizer would encode it (as a model
    may generate them): every word split into single characters at random."""
    rng = random.Random(seed)
    ids = []
    for piece in encode(tokenizer, text):
        chars = tokenizer.decode([piece])
        if rng.random() < 0.5 and len(chars) > 1 and chars.isascii() and "<" not in chars:
            ids += [tokenizer.convert_tokens_to_ids(c) for c in chars if c.isalnum()] \
                if chars.isalnum() else [piece]
        else:
            ids.append(piece)
    return ids


def render(tokenizer, messages, memory, tools=None, template=None, **options):
    kwargs = {"chat_template": template} if template else {}
    return render_prompt(tokenizer, messages, tools, kwargs,
                         RenderOptions(memory=memory, think_start="<think>", **options))


def first_turn(tokenizer, memory, body, message, template=None, tools=None):
    rendered = render(tokenizer, [SYSTEM, USER], memory, tools=tools, template=template)
    memory.remember(message, body, rendered.opening, bool(message.get("reasoning_content")),
                    rendered.prefix)
    return rendered


@pytest.mark.parametrize("template", [None, QWEN3_LIKE], ids=["tiny", "qwen3-like"])
def test_second_turn_extends_prompt_plus_generated_tokens(tokenizer, template):
    memory = TurnMemory()
    body = odd_body(tokenizer, '<think>\nhot or cold\n</think>\n\nLet me check.\n<tool_call>\n'
                               '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                               '</tool_call>')
    returned = {"role": "assistant", "content": "Let me check.\n", "tool_calls": [CALL],
                "reasoning_content": "hot or cold"}
    first = first_turn(tokenizer, memory, body, returned, template, TOOLS)
    history = [SYSTEM, USER, returned, {"role": "tool", "tool_call_id": "call_1",
                                        "content": "18C"}]
    second = render(tokenizer, history, memory, tools=TOOLS, template=template)
    assert second.num_spliced == 1 and second.num_spliced_tokens == len(body)
    assert second.ids[:len(first.ids) + len(body)] == first.ids + body
    assert "18C" in tokenizer.decode(second.ids[len(first.ids) + len(body):])
    # Without prefix-stable rendering the template's own rendering breaks the prefix.
    plain = render(tokenizer, history, memory, tools=TOOLS, template=template,
                   prefix_stable=False)
    assert plain.num_spliced == 0
    assert plain.ids[:len(first.ids) + len(body)] != first.ids + body


def test_three_turns_and_lookup_by_hash(tokenizer):
    memory = TurnMemory()
    body1 = odd_body(tokenizer, "It is sunny in Paris today.", 1)
    reply1 = {"role": "assistant", "content": "It is sunny in Paris today."}
    first = first_turn(tokenizer, memory, body1, reply1)
    user2 = {"role": "user", "content": "And tomorrow?"}
    # The client sends the text back with whitespace changed and no id: found by hash.
    sent_back = {"role": "assistant", "content": "  It is sunny in Paris today.\n"}
    second = render(tokenizer, [SYSTEM, USER, sent_back, user2], memory)
    assert second.ids[:len(first.ids) + len(body1)] == first.ids + body1
    body2 = odd_body(tokenizer, "Rain, probably.", 2)
    reply2 = {"role": "assistant", "content": "Rain, probably."}
    memory.remember(reply2, body2, second.opening, False, second.prefix)
    third = render(tokenizer, [SYSTEM, USER, sent_back, user2, reply2,
                               {"role": "user", "content": "Thanks"}], memory)
    assert third.num_spliced == 2
    assert third.ids[:len(second.ids) + len(body2)] == second.ids + body2


def test_thinking_model_opening_is_restored(tokenizer):
    """The generation prompt ended in `<think>\\n`; the template renders the old turn without
    it, so the splice adds it back."""
    memory = TurnMemory()
    body = odd_body(tokenizer, "short plan\n</think>\n\nDone.")
    reply = {"role": "assistant", "content": "Done.", "reasoning_content": "short plan"}
    first = first_turn(tokenizer, memory, body, reply, THINKING)
    assert first.opening.endswith("<think>\n")
    history = [SYSTEM, USER, reply, {"role": "user", "content": "next"}]
    second = render(tokenizer, history, memory, template=THINKING)
    assert second.num_spliced == 1
    assert second.ids[:len(first.ids) + len(body)] == first.ids + body


def test_lookup_by_tool_call_id_needs_the_same_calls(tokenizer):
    memory = TurnMemory()
    reply = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    memory.remember(reply, [1, 2, 3], None, False)
    # Same call id, arguments re-serialised by the client: still the same call.
    same = {"role": "assistant", "content": None, "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert memory.lookup(same) is not None
    changed = {"role": "assistant", "content": "", "tool_calls": [
        {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}
    assert memory.lookup(changed) is None


def test_memory_is_bounded_and_forgets_the_oldest():
    memory = TurnMemory(max_turns=3)
    for i in range(5):
        memory.remember({"role": "assistant", "content": f"reply {i}",
                         "tool_calls": [{**CALL, "id": f"call_{i}"}]}, [i + 1], None, False)
    assert len(memory) == 3
    assert memory.lookup({"role": "assistant", "content": "reply 0",
                          "tool_calls": [{**CALL, "id": "call_0"}]}) is None
    assert list(memory.lookup({"role": "assistant", "content": "reply 4",
                               "tool_calls": [{**CALL, "id": "call_4"}]}).body) == [5]
    assert set(memory._by_call) == {"call_2", "call_3", "call_4"}


def test_message_key_ignores_ids_reasoning_and_outer_whitespace():
    a = {"role": "assistant", "content": " hi ", "tool_calls": [CALL]}
    b = {"role": "assistant", "content": "hi", "reasoning_content": "x", "tool_calls": [
        {**CALL, "id": "other", "function": {"name": "get_weather",
                                             "arguments": json.dumps({"city": "Paris"})}}]}
    assert message_key(a) == message_key(b)
    assert message_key(a) != message_key({"role": "assistant", "content": "hi"})


def test_reasoning_not_kept_means_no_splice_of_turns_with_reasoning(tokenizer):
    memory = TurnMemory()
    body = odd_body(tokenizer, "<think>\nx\n</think>\n\nDone.")
    reply = {"role": "assistant", "content": "Done.", "reasoning_content": "x"}
    first_turn(tokenizer, memory, body, reply)
    history = [SYSTEM, USER, reply, {"role": "user", "content": "next"}]
    dropped = render(tokenizer, history, memory, keep_reasoning=False)
    assert dropped.num_spliced == 0
    assert "<think>" not in tokenizer.decode(dropped.ids)
    assert render(tokenizer, history, memory).num_spliced == 1


def test_template_that_mangles_the_sentinel_falls_back(tokenizer):
    upper = "{%- for m in messages %}{{ m.role + ': ' + (m.content or '') | upper }}\n" \
            "{%- endfor %}{%- if add_generation_prompt %}assistant: {% endif %}"
    memory = TurnMemory()
    reply = {"role": "assistant", "content": "ok"}
    memory.remember(reply, [5, 6, 7], "assistant: ", False)
    rendered = render(tokenizer, [USER, reply, {"role": "user", "content": "b"}], memory,
                      template=upper)
    assert rendered.num_spliced == 0
    assert tokenizer.decode(rendered.ids).startswith("user: WEATHER")


def test_template_errors_are_a_400(tokenizer):
    failing = "{{ raise_exception('no system messages') }}"
    with pytest.raises(APIError) as info:
        render(tokenizer, [SYSTEM, USER], TurnMemory(), template=failing)
    assert info.value.status == 400 and info.value.code == "invalid_messages"


def test_template_that_rejects_the_call_sentinel_gets_the_plain_one(tokenizer):
    """Calls are kept in the sentinel message (with the sentinel as their argument) when the
    stop tokens are known; a template that refuses that argument gets the content sentinel."""
    picky = QWEN3_LIKE.replace(
        "{%- for tc in message.tool_calls or [] %}",
        "{%- for tc in message.tool_calls or [] %}{%- if tc.function.arguments.city is not "
        "defined %}{{ raise_exception('city required') }}{%- endif %}")
    memory = TurnMemory()
    body = odd_body(tokenizer, 'Let me check.\n<tool_call>\n{"name": "get_weather", '
                               '"arguments": {"city": "Paris"}}\n</tool_call>')
    returned = {"role": "assistant", "content": "Let me check.\n", "tool_calls": [CALL]}
    first = render(tokenizer, [SYSTEM, USER], memory, tools=TOOLS, template=picky,
                   turn_ends=("<|im_end|>",))
    memory.remember(returned, body, first.opening, False, first.prefix)
    history = [SYSTEM, USER, returned, {"role": "tool", "tool_call_id": "call_1",
                                        "content": "18C"}]
    second = render(tokenizer, history, memory, tools=TOOLS, template=picky,
                    turn_ends=("<|im_end|>",))
    assert second.num_spliced == 1
    assert second.ids[:len(first.ids) + len(body)] == first.ids + body


# SmolLM2-Instruct's ChatML template: every message written as role + content; tools, calls and
# the tool role's meaning are dropped (gateway/prompting/tool_text.py writes them as text).
CHATML_NO_TOOLS = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("as_text", [True, False], ids=["tools-as-text", "template-only"])
def test_template_without_tools_replays_calls_written_as_text(tokenizer, as_text):
    from switchyard.gateway.output.tools import HERMES

    options = {"turn_ends": ("<|im_end|>",), "tools_as_text": HERMES if as_text else None}
    memory = TurnMemory()
    body = odd_body(tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": '
                               '{"city": "Paris"}}\n</tool_call>')
    returned = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    first = render(tokenizer, [SYSTEM, USER], memory, tools=TOOLS, template=CHATML_NO_TOOLS,
                   **options)
    assert ("get_weather" in tokenizer.decode(first.ids)) == as_text  # the model sees its tools
    memory.remember(returned, body, first.opening, False, first.prefix)
    history = [SYSTEM, USER, returned, {"role": "tool", "tool_call_id": "call_1",
                                        "content": "18C"}]
    second = render(tokenizer, history, memory, tools=TOOLS, template=CHATML_NO_TOOLS,
                    **options)
    if not as_text:  # the template drops the call: nothing to splice, the prefix breaks
        assert second.num_spliced == 0
        assert second.ids[:len(first.ids) + len(body)] != first.ids + body
        return
    assert second.num_spliced == 1
    assert second.ids[:len(first.ids) + len(body)] == first.ids + body
    rest = tokenizer.decode(second.ids[len(first.ids) + len(body):])
    assert rest.startswith("<|im_end|>") and "<tool_response>\n18C\n</tool_response>" in rest
    # Forgotten turns render the same text from the call itself.
    plain = render(tokenizer, history, TurnMemory(), tools=TOOLS, template=CHATML_NO_TOOLS,
                   **options)
    assert tokenizer.decode(plain.ids) == tokenizer.decode(first.ids + body + encode(
        tokenizer, rest))


def test_a_template_variable_cannot_blow_the_rendering_past_the_context(tokenizer):
    """A value the template repeats or loops over (here `repeat`) makes a rendering longer than
    ctx tokens can hold: refused before any of it is tokenized ."""
    bomb = "{% for m in messages %}{{ m.content * repeat }}{% endfor %}"
    original = tokenizer.chat_template
    tokenizer.chat_template = bomb
    try:
        options = RenderOptions(max_chars=10_000)
        ok = render_prompt(tokenizer, [USER], None, {"repeat": 10}, options)
        assert ok.ids
        with pytest.raises(APIError) as raised:
            render_prompt(tokenizer, [USER], None, {"repeat": 100_000}, options)
        assert raised.value.code == "context_length_exceeded"
    finally:
        tokenizer.chat_template = original


def test_reasoning_the_template_drops_is_noted_unseen(tokenizer):
    """Qwen3-like templates drop reasoning of turns before the last user query: the model
    never sees it (the Responses store then does not keep it)."""
    early = {"role": "assistant", "content": "a1", "reasoning_content": "early thoughts"}
    late = {"role": "assistant", "content": "a2", "reasoning_content": "late thoughts"}
    messages = [USER, early, {"role": "user", "content": "more"}, late]
    original = tokenizer.chat_template
    tokenizer.chat_template = QWEN3_LIKE
    try:
        rendered = render_prompt(tokenizer, messages, None, {}, RenderOptions(note_unseen=True))
        assert rendered.unseen_reasoning == {1}
        plain = render_prompt(tokenizer, messages, None, {}, RenderOptions())
        assert plain.unseen_reasoning == frozenset()
    finally:
        tokenizer.chat_template = original


def test_a_reply_is_spliced_only_after_the_tokens_it_followed(tokenizer):
    """Conversation B's "Done." carried private reasoning; conversation A
    sends its own history with the reply "Done.": A renders as the template renders it
    (B's hidden tokens never reach A's prompt), and B still gets its own tokens back."""
    memory = TurnMemory()
    secret = encode(tokenizer, "<think>\nB's private plan\n</think>\n\nDone.")
    done = {"role": "assistant", "content": "Done."}
    b_first = render(tokenizer, [SYSTEM, {"role": "user", "content": "B asks"}], memory)
    memory.remember(done, secret, b_first.opening, True, b_first.prefix)
    a_history = [SYSTEM, {"role": "user", "content": "A asks"}, done,
                 {"role": "user", "content": "next"}]
    a = render(tokenizer, a_history, memory)
    assert a.num_spliced == 0
    assert a.ids == render(tokenizer, a_history, memory, prefix_stable=False).ids
    assert "private" not in tokenizer.decode(a.ids)
    b = render(tokenizer, [SYSTEM, {"role": "user", "content": "B asks"}, done,
                           {"role": "user", "content": "next"}], memory)
    assert b.num_spliced == 1 and b.ids[:len(b_first.ids) + len(secret)] == \
        b_first.ids + secret


def test_many_replies_matching_other_conversations_cost_bounded_renderings(tokenizer,
                                                                              monkeypatch):
    from switchyard.gateway.prompting import history

    memory = TurnMemory()
    done = {"role": "assistant", "content": "Done."}
    first = render(tokenizer, [SYSTEM, {"role": "user", "content": "B"}], memory)
    memory.remember(done, encode(tokenizer, "Done."), first.opening, False, first.prefix)
    calls = []
    real = history.apply_template
    monkeypatch.setattr(history, "apply_template",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    messages = [SYSTEM]
    for i in range(40):
        messages += [{"role": "user", "content": f"A {i}"}, done]
    rendered = render(tokenizer, messages, memory)
    assert rendered.num_spliced == 0
    assert len(calls) <= history.MAX_SPLICE_RETRIES + 3  # probes of the opening included


def test_a_cut_call_is_found_as_either_api_sends_it_back():
    """A forced call the token limit cut: a Chat client sends back its text, an Anthropic
    client the members written in full (`input`); both find the remembered turn."""
    memory = TurnMemory()
    cut = '{"path": "a.py", "line": 12'
    call = {"id": "toolu_1", "type": "function", "function": {"name": "edit", "arguments": cut}}
    memory.remember({"role": "assistant", "content": "", "tool_calls": [call]}, [1, 2], None,
                    False, b"p")
    as_chat = {"role": "assistant", "content": None, "tool_calls": [call]}
    as_anthropic = {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "edit", "arguments": json.dumps({"path": "a.py"})}}]}
    assert memory.lookup(as_chat, b"p") is not None
    assert memory.lookup(as_anthropic, b"p") is not None
