"""Request validation: every bad field is a 400 naming the field; prompts and SubmitRequest."""

import pytest

from switchyard.gateway.errors import APIError
from switchyard.gateway.prompting.prompts import build_submit, check_model, served_model_id
from switchyard.gateway.api.json_body import parse_json
from switchyard.gateway.api.openai_request import parse_chat_request, parse_completion_request
from switchyard.gateway.request.model import (Options, TurnChoices, header_priority,
                                               request_priority)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields):
    return parse_chat_request({**CHAT, **fields})


def error_of(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b'{"a": NaN}',
                                 b'{"t": Infinity}', b"", b"[" * 100_000])
def test_malformed_or_non_object_json_is_a_400(raw):
    error = error_of(parse_json, raw)
    assert error.status == 400 and error.code == "invalid_json"
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_minimal_chat_gets_openai_defaults():
    request = chat()
    assert request.messages == [{"role": "user", "content": "hi"}]
    assert request.options == Options(model="m")
    assert request.options.temperature == 1.0 and request.options.max_tokens is None


def test_unknown_fields_are_ignored():
    assert chat(frequency_penalty=0.5, metadata={"x": 1}, store=True).options.model == "m"


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("temperature", True), ("temperature", -0.1),
    ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("top_k", 1.5), ("top_k", -1), ("top_k", 10**30),
    ("min_p", 2), ("max_tokens", 0), ("max_tokens", "10"), ("max_tokens", 10.5),
    ("max_completion_tokens", -5), ("seed", "x"), ("seed", 2**70), ("stream", "yes"),
    ("stop", 5), ("stop", ["a", 1]), ("stop", ["s"] * 17), ("user", 7), ("model", 3),
    ("priority", "urgent"), ("tools", {"a": 1}), ("tools", [1]), ("tool_choice", 3),
    ("messages", "hi"), ("logprobs", True), ("top_logprobs", 2),
    ("response_format", {"type": "xml"}), ("response_format", 5),
    ("chat_template_kwargs", []),
])
def test_bad_field_is_a_400_naming_it(field, value):
    error = error_of(chat, **{field: value})
    assert error.status == 400
    assert error.param == field
    assert field in error.message


def test_stream_options_field_is_checked():
    error = error_of(chat, stream=True, stream_options={"include_usage": "yes"})
    assert error.param == "stream_options.include_usage"
    assert chat(stream=True, stream_options={"include_usage": True}).options.include_usage


@pytest.mark.parametrize("n,ok", [(1, True), (None, True), (2, False), (0, False)])
def test_only_n_1(n, ok):
    if ok:
        chat(n=n)
    else:
        assert error_of(chat, n=n).param == "n"


@pytest.mark.parametrize("messages,param", [
    ([], "messages"), (None, "messages"), ([1], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"), ([{"role": "wizard", "content": "x"}],
                                               "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
     "messages[0].content[0].image_url.url"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
     "messages[0].content[0].text"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
    ([{"role": "assistant", "content": None, "tool_calls": "x"}], "messages[0].tool_calls"),
    ([{"role": "tool", "content": "x", "tool_call_id": 5}], "messages[0].tool_call_id"),
])
def test_bad_messages(messages, param):
    error = error_of(parse_chat_request, {"messages": messages})
    assert error.status == 400 and error.param == param


def test_content_parts_are_flattened_and_other_keys_kept():
    request = chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                        "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "1", "type": "function",
                         "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"},
    ])
    assert request.messages[0]["content"] == "a\nb"
    assert request.messages[1]["tool_calls"][0]["function"]["name"] == "f"
    assert request.messages[2]["tool_call_id"] == "1"


def test_developer_role_is_rendered_as_system():
    request = chat(messages=[{"role": "developer", "content": "rules"},
                             {"role": "user", "content": "hi"}])
    assert request.messages[0] == {"role": "system", "content": "rules"}


def test_options_are_parsed():
    options = chat(max_tokens=5, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=3,
                   min_p=0.1, seed=-1, stop="END", stream=True, user="u",
                   priority="background").options
    assert options.max_tokens == 7  # max_completion_tokens wins
    assert (options.temperature, options.top_p, options.top_k, options.min_p) == (0, .5, 3, .1)
    assert 0 <= options.seed < 2**63
    assert options.stop == ("END",) and options.stream and options.priority == "background"
    assert chat(stop=["a", "", "b"]).options.stop == ("a", "b")


def test_template_kwargs_cannot_replace_the_template_or_its_arguments():
    request = chat(chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
    assert request.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    for key in ("chat_template", "messages", "add_generation_prompt", "tokenize", "tools",
                "tokenizer_kwargs", "continue_final_message"):
        error = error_of(chat, chat_template_kwargs={key: "{{ 'ab ' * 3000 }}"})
        assert error.status == 400 and error.param == f"chat_template_kwargs.{key}"
    error = error_of(chat, chat_template="{{ messages }}")
    assert error.status == 400 and error.param == "chat_template"


def test_template_kwargs_values_are_bounded():
    error = error_of(chat, chat_template_kwargs={"system_hint": "x" * 20_000})
    assert error.status == 400 and "larger than" in error.message


@pytest.mark.parametrize("prompt,expected", [
    ("hello", "hello"), ([1, 2, 3], (1, 2, 3)), (["hello"], "hello"), ([[4, 5]], (4, 5)),
])
def test_completion_prompt_forms(prompt, expected):
    assert parse_completion_request({"prompt": prompt}).prompt == expected


@pytest.mark.parametrize("prompt", [None, "", [], [1, "a"], [True], ["a", "b"], 5, {"a": 1},
                                    [[1], [2]], [1.5]])
def test_bad_completion_prompts(prompt):
    error = error_of(parse_completion_request, {"prompt": prompt})
    assert error.status == 400 and error.param == "prompt"


@pytest.mark.parametrize("field,value", [("echo", True), ("logprobs", 2), ("suffix", "x"),
                                         ("best_of", 3)])
def test_unsupported_completion_options(field, value):
    error = error_of(parse_completion_request, {"prompt": "x", field: value})
    assert error.param == field and error.code == "unsupported_parameter"


def test_priority_header():
    assert header_priority({"x-switchyard-priority": "background"}) == "background"
    assert header_priority({}) is None
    assert error_of(header_priority, {"x-switchyard-priority": "now"}).status == 400


def test_a_background_model_name_asks_for_background():
    subagents = ("local-subagents",)
    assert request_priority(Options(model="local-subagents"), {}, subagents) == "background"
    assert request_priority(Options(model="local"), {}, subagents) == "interactive"
    assert request_priority(Options(), {}, subagents) == "interactive"
    assert request_priority(Options(model="local-subagents"),
                            {"x-switchyard-priority": "interactive"}, subagents) == "interactive"


def choices_of(options: Options, headers=None) -> TurnChoices:
    return TurnChoices(salt=b"", priority=request_priority(options, headers or {}, ()))


def submit(prompt_len=10, ctx=100, **option_fields):
    options = Options(**option_fields)
    return build_submit("r1", list(range(prompt_len)), options, ctx=ctx,
                        default_max_tokens=50, stop_token_ids=(7,), choices=choices_of(options))


def test_submit_clamps_max_tokens_to_the_context():
    assert submit(prompt_len=10).max_tokens == 50  # default
    assert submit(prompt_len=10, max_tokens=10**30).max_tokens == 90
    assert submit(prompt_len=10, max_tokens=500).max_tokens == 90
    assert submit(prompt_len=99, max_tokens=500).max_tokens == 1
    assert submit(prompt_len=10, max_tokens=3).max_tokens == 3


def test_prompt_that_leaves_no_room_is_context_length_exceeded():
    error = error_of(submit, prompt_len=100, ctx=100)
    assert error.status == 400 and error.code == "context_length_exceeded"


def test_submit_always_has_a_seed_and_eos_ids():
    a, b = submit(), submit()
    assert a.sampling.seed != b.sampling.seed  # drawn at random (2**63 space)
    assert submit(seed=42).sampling.seed == 42
    assert a.stop_token_ids == (7,) and a.priority == "interactive"
    assert submit(priority="background").priority == "background"


def test_body_priority_overrides_header():
    header = {"x-switchyard-priority": "background"}
    assert choices_of(Options(priority="interactive"), header).priority == "interactive"
    assert choices_of(Options(), header).priority == "background"


def test_served_model_id(tmp_path):
    model_dir = tmp_path / "Qwen3-8B-MLX"
    model_dir.mkdir()
    assert served_model_id(str(model_dir)) == "Qwen3-8B-MLX"
    assert served_model_id(str(model_dir) + "/") == "Qwen3-8B-MLX"
    assert served_model_id("/models/qwen3-30b-q4.gguf") == "qwen3-30b-q4"
    assert served_model_id("mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"


def test_check_model():
    check_model(None, "m")
    check_model("m", "m")
    check_model("/path/m", "m", aliases=("/path/m",))
    error = error_of(check_model, "gpt-4", "m")
    assert error.status == 404 and error.code == "model_not_found"


ODD_VALUES = [None, True, False, 0, -1, 1, 2, 7, 0.5, -0.0, 1e308, -1e308, 2**64, -(2**64),
              10**30, "", "x", "interactive", "background", "text", [], [1], ["a"], [None],
              {}, {"type": "text"}, {"include_usage": "no"}, {"include_usage": True},
              [{"role": "user", "content": "x"}], [{"role": "user", "content": [{}]}]]
FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options", "user", "tools",
          "tool_choice", "priority", "logprobs", "top_logprobs", "response_format",
          "chat_template_kwargs", "prompt", "echo", "suffix", "best_of"]


def test_random_bodies_give_a_request_or_a_400_never_anything_else():
    import random

    from switchyard.proto import codec

    rng = random.Random(0)
    for _ in range(3000):
        body = {name: rng.choice(ODD_VALUES) for name in rng.sample(FIELDS, rng.randint(0, 8))}
        body.setdefault("messages", [{"role": "user", "content": "x"}])
        body.setdefault("prompt", "x")
        for parse in (parse_chat_request, parse_completion_request):
            try:
                request = parse(body)
                submitted = build_submit("r", [1, 2], request.options, ctx=64,
                                         default_max_tokens=8, stop_token_ids=(0,),
                                         choices=choices_of(request.options))
                # everything must fit the wire, with the types the scheduler's decoder checks
                assert codec.decode(codec.encode(submitted)) == submitted
            except APIError as error:
                assert error.status == 400 and error.body()["error"]["message"]


def test_an_integral_number_is_an_integer():
    """JSON has one number type: 10.0 is 10 (JSON Schema, and the published spec, agree)."""
    assert chat(max_tokens=10.0).options.max_tokens == 10
    assert isinstance(chat(max_tokens=10.0).options.max_tokens, int)
    assert chat(max_tokens=1e20).options.max_tokens == 10**20  # limited later, by the context


def test_a_request_may_opt_out_of_speculative_decoding_in_every_api():
    from switchyard.gateway.api.anthropic_api import parse_messages_request
    from switchyard.gateway.api.responses_api import parse_responses_request
    from switchyard.gateway.request.response_store import ResponseStore

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(chat).options.speculative is True
    assert parse_chat_request(chat | {"speculative": False}).options.speculative is False
    assert parse_completion_request({"prompt": "x", "speculative": False}).options.speculative \
        is False
    anthropic = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert parse_messages_request(anthropic | {"speculative": False}).chat.options.speculative \
        is False
    store = ResponseStore(4)
    assert parse_responses_request({"input": "hi", "speculative": False},
                                   store).chat.options.speculative is False
    with pytest.raises(APIError, match="speculative"):
        parse_chat_request(chat | {"speculative": "no"})
    options = Options(speculative=False)
    request = build_submit("r", [1], options, ctx=10, default_max_tokens=5,
                           stop_token_ids=(), choices=choices_of(options))
    assert request.speculative is False


@pytest.mark.parametrize("summary", [{}, 0, False])
def test_a_reasoning_item_whose_text_is_not_text_is_a_400(summary):
    """schemathesis: a reasoning item with `summary: {}` was read as no summary (a falsy value
    taken for absent); the spec says a string or text parts."""
    from switchyard.gateway.api.responses_api import parse_input

    with pytest.raises(APIError) as raised:
        parse_input([{"type": "reasoning", "summary": summary}])
    assert raised.value.param == "input[0].summary"
    assert parse_input([{"type": "reasoning", "summary": None, "content": ""}])


def test_max_tokens_is_checked_beside_max_completion_tokens():
    """schemathesis: `max_tokens: 0` was accepted when `max_completion_tokens` was given."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1}
    with pytest.raises(APIError) as raised:
        parse_chat_request(body | {"max_tokens": 0})
    assert raised.value.param == "max_tokens"
    assert parse_chat_request(body | {"max_tokens": 50}).options.max_tokens == 1


def test_an_assistant_tool_call_of_another_type_is_a_400():
    """schemathesis: a tool call with `type: {}` was accepted (the spec says "function")."""
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    for kind in ({}, "retrieval", 1):
        with pytest.raises(APIError) as raised:
            parse_chat_request({"messages": [{"role": "assistant", "content": None,
                                              "tool_calls": [call | {"type": kind}]}]})
        assert raised.value.param == "messages[0].tool_calls[0].type"
    for kind in ("function", None):
        parse_chat_request({"messages": [{"role": "assistant", "content": None,
                                          "tool_calls": [call | {"type": kind}]}]})


def test_a_responses_message_may_leave_out_its_type():
    """OpenAI's EasyInputMessage: `type` left out, or null (the spec declares it optional)."""
    from switchyard.gateway.api.responses_api import parse_input

    for item in ({"role": "user", "content": "hi"},
                 {"type": None, "role": "user", "content": "hi"}):
        assert parse_input([item]) == [{"role": "user", "content": "hi"}]


def test_reasoning_is_checked_under_both_names():
    """schemathesis: `reasoning: {}` beside `reasoning_content: null` was accepted."""
    base = {"role": "assistant", "content": "x"}
    for extra, param in (({"reasoning_content": None, "reasoning": {}}, "reasoning"),
                         ({"reasoning": 3}, "reasoning"), ({"reasoning_content": []},
                                                          "reasoning_content")):
        with pytest.raises(APIError) as raised:
            parse_chat_request({"messages": [base | extra]})
        assert raised.value.param == f"messages[0].{param}"
    chat = parse_chat_request({"messages": [base | {"reasoning_content": None,
                                                    "reasoning": "thought"}]})
    assert chat.messages[0]["reasoning_content"] == "thought"


NINES = "9" * 5000


@pytest.mark.parametrize("field, value, param", [
    ("priority", f"x - at `$.a[{NINES}]`", "priority"),
    ("priority", "x - at `$.messages[0].content`", "priority"),
    ("messages", [{"role": "x - at `$.tools[3]`", "content": "hi"}], "messages[0].role"),
    ("messages", [{"role": "user", "content": [{"type": f"x - at `key` in `$[{NINES}]`"}]}],
     "messages[0].content[0].type"),
    ("response_format", {"type": "x - at `$.stop`"}, "response_format"),
    ("logit_bias", {NINES: 1}, "logit_bias"),
    ("logit_bias", {"x - at `$.messages`": 1}, "logit_bias"),
])
def test_a_value_echoing_an_error_path_is_a_400_naming_its_own_field(field, value, param):
    """msgspec echoes a bad value in its message: the path is read from the end only, no
    int() is applied to a client's digits, and the injected text never chooses the param."""
    error = error_of(chat, **{field: value})
    assert error.status == 400 and error.param == param, (error.param, error.message[:200])
