"""Tools written as text for a chat template that does not render them (Hermes, as Qwen2.5's
template writes them): the tool list in the system message, calls as the model writes them,
consecutive results in one user turn."""

import json

from switchyard.gateway.output.formats import FORMATS
from switchyard.gateway.output.tools import HERMES
from switchyard.gateway.prompting.tool_text import (messages_with_tools_as_text,
                                                    template_renders_tools, text_syntax)

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def call(i, city):
    return {"id": f"c{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": city}}}


def test_conversation_as_text():
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Paris and Rome?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [call(1, "Paris"),
                                                                             call(2, "Rome")]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"},
                {"role": "tool", "tool_call_id": "c2", "content": "25C"},
                {"role": "assistant", "content": "Rome is warmer."}]
    out = messages_with_tools_as_text(messages, [TOOL], HERMES)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in system
    assert system.endswith('<tool_call>\n{"name": <function-name>, "arguments": '
                           '<args-json-object>}\n</tool_call>')
    assert out[2] == {"role": "assistant", "content":
                      'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                      '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
                      '"arguments": {"city": "Rome"}}\n</tool_call>'}
    assert out[3]["content"] == ("<tool_response>\n18C\n</tool_response>\n"
                                 "<tool_response>\n25C\n</tool_response>")
    assert out[4] == messages[5]
    assert messages[2]["tool_calls"], "the caller's messages are left alone"


def test_no_system_message_gets_one_and_no_tools_adds_none():
    user = {"role": "user", "content": "hi"}
    out = messages_with_tools_as_text([user], [TOOL], HERMES)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools") and out[1] == user
    assert messages_with_tools_as_text([user], None, HERMES) == [user]


def test_other_call_syntaxes_show_an_example_of_their_own():
    mistral = FORMATS["mistral_args"].tools
    out = messages_with_tools_as_text([{"role": "user", "content": "x"}], [TOOL], mistral)
    assert mistral.render("function_name", {"argument": "value"}) in out[0]["content"]


class Template:
    """A tokenizer stand-in: apply_chat_template renders with one jinja template."""

    def __init__(self, source: str) -> None:
        import jinja2

        self.template = jinja2.Environment().from_string(source)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False,
                            tokenize=False):
        return self.template.render(messages=messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt)


def test_which_templates_get_tools_as_text():
    chatml = Template("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                      "<|im_end|>\n{% endfor %}")
    with_tools = Template("{% for t in tools or [] %}{{ t | tojson }}{% endfor %}"
                          "{% for m in messages %}{{ m.content }}{% endfor %}")
    failing = Template("{{ raise_exception('no') }}")
    assert not template_renders_tools(chatml) and text_syntax(chatml, HERMES) is HERMES
    assert template_renders_tools(with_tools) and text_syntax(with_tools, HERMES) is None
    assert text_syntax(failing, HERMES) is None
