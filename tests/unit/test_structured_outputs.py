"""Structured outputs, without a model: request fields compile to grammars (or a 400 naming
what is wrong), and whatever tokens a sampler picks under a grammar's masks, the output parses
and validates (random schemas, random allowed tokens, the tiny tokenizer's real vocabulary)."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from switchyard.gateway.request import structured
from switchyard.gateway.errors import APIError
from switchyard.gateway.output.call_grammar import UnsupportedCallFormat, call_grammar, token_literals
from switchyard.gateway.output.tools import HERMES, ToolSyntax, _parse_json
from tests.helpers.schemas import random_object_schema, random_schema

llguidance = pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    """(llguidance tokenizer, HF tokenizer) of the tiny model's byte-level BPE vocabulary."""
    import llguidance.hf
    from transformers import PreTrainedTokenizerFast

    from switchyard.twins.tokenizer import tokenizer_files

    directory = tmp_path_factory.mktemp("tok")
    for name, data in tokenizer_files().items():
        (directory / name).write_bytes(data)
    hf = PreTrainedTokenizerFast.from_pretrained(str(directory))
    return llguidance.hf.from_tokenizer(hf, eos_token=hf.eos_token_id), hf


def sample_under(tokenizer, grammar: str, rng: random.Random, max_tokens: int = 600,
                 prefix: list[int] = ()) -> tuple[list[int], bool]:
    """Pick random allowed tokens (ending as soon as the grammar allows) until it stops."""
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    out = []
    for _ in range(max_tokens):
        if matcher.is_stopped():
            return out, True
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                             bitorder="little")
        allowed = np.nonzero(bits)[0]
        eos = tokenizer.eos_token
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return out, True
        allowed = allowed[allowed != eos]
        token = int(rng.choice(allowed))
        assert matcher.consume_token(token), matcher.get_error()
        out.append(token)
    return out, False


def error_of(fn, *args) -> APIError:
    with pytest.raises(APIError) as caught:
        fn(*args)
    return caught.value


# --- request fields -----------------------------------------------------------------------


def checked_json_schema(schema, param):
    return structured.check_now(structured.json_schema(schema, param))


def test_unsupported_schema_keywords_are_named():
    error = error_of(checked_json_schema, {"type": "object", "$dynamicRef": "#x"}, "p")
    assert error.status == 400 and "$dynamicRef" in error.message and error.param == "p"
    error = error_of(checked_json_schema, {"type": "string", "format": "colour"}, "p")
    assert "colour" in error.message
    error = error_of(checked_json_schema, {"type": "nope"}, "p")
    assert "nope" in error.message


@pytest.mark.parametrize("value", [5, {"type": "xml"}, {"type": "json_schema"},
                                   {"type": "json_schema", "json_schema": {"name": "x"}}])
def test_bad_response_format_is_a_400(value):
    assert error_of(structured.openai_response_format, value).param == "response_format"


def test_response_formats_compile():
    assert structured.openai_response_format({"type": "text"}) is None
    assert structured.openai_response_format({"type": "json_object"}).grammar
    spec = {"type": "json_schema", "json_schema": {"name": "t", "strict": True,
                                                  "schema": {"type": "object"}}}
    assert structured.openai_response_format(spec).grammar
    assert structured.responses_text_format({"type": "json_schema", "name": "t",
                                             "schema": {"type": "object"}}).grammar


def test_guided_fields_compile_and_only_one_is_allowed():
    assert structured.guided({"guided_regex": "[a-z]+"}).grammar
    assert structured.guided({"guided_choice": ["yes", "no"]}).grammar
    assert structured.guided({"guided_json": '{"type": "integer"}'}).grammar
    assert structured.guided({"guided_grammar": 'start: "a" | "b"'}).grammar
    assert structured.guided({"guided_grammar": 'root ::= "a" | "b"'}).grammar  # GBNF
    assert structured.guided({"structured_outputs": {"choice": ["x"]}}).grammar
    assert structured.guided({}) is None
    error = error_of(structured.guided, {"guided_regex": "a", "guided_choice": ["a"]})
    assert "guided_regex" in error.message
    assert error_of(structured.guided, {"guided_choice": []}).param == "guided_choice"
    unclosed = structured.guided({"guided_regex": "(unclosed"})
    assert error_of(structured.check_now, unclosed).param == "guided_regex"


def test_guided_choice_is_bounded_in_count_and_bytes():
    """100,000 options held the event loop for 3.6 s."""
    error = error_of(structured.guided, {"guided_choice": [str(i) for i in range(100_000)]})
    assert error.status == 400 and "more than" in error.message
    error = error_of(structured.guided, {"guided_choice": ["x" * 40_000, "y" * 40_000]})
    assert "larger than" in error.message
    assert structured.guided({"guided_choice": [str(i) for i in range(1024)]}).grammar


def test_oversized_constraints_are_refused_before_compiling():
    huge = {"enum": [f"value-{i}" for i in range(20_000)]}
    assert "larger than" in error_of(structured.json_schema, huge, "p").message
    assert "larger than" in error_of(structured.lark, "start: " + '"a" | ' * 20_000 + '"b"',
                                     "g").message
    assert "larger than" in error_of(structured.regex, "a" * 100_000, "r").message


def test_a_deep_reference_chain_compiles_to_a_shared_grammar():
    """$refs become shared rules, not copies: 60 levels of three-way references compile."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"},
                                {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}},
                                {"type": "object", "properties": {
                                    "x": {"$ref": f"#/$defs/d{i + 1}"}}}]}
            for i in range(60)}
    defs["d60"] = {"type": "integer"}
    assert checked_json_schema({"$defs": defs, "$ref": "#/$defs/d0"}, "p").grammar


# --- what a sampler can produce under the masks -------------------------------------------


def test_random_schemas_always_validate(vocab):
    tokenizer, hf = vocab
    rng = random.Random(7)
    for i in range(200):
        schema = random_schema(rng) if i % 2 else random_object_schema(rng)
        constraint = structured.json_schema(schema, "schema")
        tokens, ended = sample_under(tokenizer, constraint.grammar, rng)
        assert ended, f"schema {i} did not end: {schema}"
        value = json.loads(hf.decode(tokens))
        jsonschema.validate(value, schema)


def test_choice_and_regex_outputs_match(vocab):
    import re

    tokenizer, hf = vocab
    rng = random.Random(3)
    for _ in range(20):
        tokens, _ = sample_under(tokenizer, structured.choice(["red", "green"], "c").grammar, rng)
        assert hf.decode(tokens) in ("red", "green")
        tokens, _ = sample_under(tokenizer, structured.regex("[a-c]{2,4}-[0-9]", "r").grammar,
                                 rng)
        assert re.fullmatch("[a-c]{2,4}-[0-9]", hf.decode(tokens))


def _marker(hf):
    return token_literals(hf.get_added_vocab())


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 14}},
           "required": ["city", "days"], "additionalProperties": False}


def _tools(*schemas):
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": s}}
            for i, s in enumerate(schemas)]


@pytest.mark.parametrize("mode,name", [("forced", "tool_1"), ("forced", None), ("auto", None)])
def test_hermes_calls_parse_and_strict_arguments_validate(vocab, mode, name):
    tokenizer, hf = vocab
    rng = random.Random(11)
    for _ in range(25):
        schemas = [random_object_schema(rng), WEATHER]
        tools = _tools(*schemas)
        grammar = call_grammar(HERMES, tools, frozenset({"tool_0", "tool_1"}), mode, name,
                               False, _marker(hf))
        constraint = structured.lark(grammar.lark, "tools", grammar.trigger)
        tokens, ended = sample_under(tokenizer, constraint.grammar, rng)
        assert ended
        opening = HERMES.forced_opening(name) if mode == "forced" else HERMES.start
        text = opening + hf.decode(tokens)
        calls = _parse_json(text[len(HERMES.start):text.index(HERMES.end)], tools)
        call = calls if isinstance(calls, dict) else calls[0]
        arguments = call["arguments"]
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        index = int(call["name"].rsplit("_", 1)[1])
        assert name is None or call["name"] == name
        jsonschema.validate(arguments, schemas[index])


def test_qwen3_coder_calls_carry_their_required_parameters(vocab):
    tokenizer, hf = vocab
    syntax = ToolSyntax("qwen3_coder", HERMES.start, HERMES.end, _parse_json)
    rng = random.Random(5)
    for _ in range(10):
        grammar = call_grammar(syntax, _tools(WEATHER), frozenset({"tool_0"}), "forced",
                               "tool_0", False, _marker(hf))
        tokens, ended = sample_under(tokenizer, structured.lark(grammar.lark, "t").grammar, rng)
        assert ended
        text = hf.decode(tokens)
        assert text.startswith("<parameter=city>\n") and "<parameter=days>\n" in text
        days = text.split("<parameter=days>\n", 1)[1].split("\n</parameter>", 1)[0]
        assert 1 <= int(days) <= 14
        assert text.endswith("</function>\n</tool_call>")


FAMILY_OF_FORMAT = {"hermes": "qwen3", "harmony": "gpt_oss", "deepseek_v31": "deepseek_v31",
                    "mistral": "mistral", "mistral_args": "mistral_args",
                    "llama3_json": "llama3"}


@pytest.fixture(scope="module")
def family_vocabs(tmp_path_factory):
    """Each family's tokenizer (its chat markers are tokens, as in the published ones)."""
    import llguidance.hf

    from fixtures.chat_formats import write_tokenizer
    from switchyard.common.tokenizer_loading import load_tokenizer

    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in set(FAMILY_OF_FORMAT.values()):
        wrapper = load_tokenizer(str(write_tokenizer(root / family, family)))
        hf = wrapper._tokenizer
        eos = sorted(wrapper.eos_token_ids)
        out[family] = (llguidance.hf.from_tokenizer(hf, eos_token=eos), hf)
    return out


@pytest.mark.parametrize("fmt", sorted(FAMILY_OF_FORMAT))
@pytest.mark.parametrize("mode,name", [("forced", "get_weather"), ("forced", None),
                                       ("auto", None)])
def test_json_argument_formats_force_calls_that_parse(family_vocabs, fmt, mode, name):
    """Forced and auto calls in each JSON-argument format (Hermes, harmony, DeepSeek, Mistral,
    Llama 3): whatever allowed tokens are picked, the call parses and its arguments validate."""
    from switchyard.gateway.output.formats import FORMATS
    from switchyard.gateway.output.tools import parse_calls
    from switchyard.gateway.request.tools import parse_openai_tools

    syntax = FORMATS[fmt].tools
    tokenizer, hf = family_vocabs[FAMILY_OF_FORMAT[fmt]]
    raw = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                             "strict": True}},
           {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
               "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}}}]
    tools = parse_openai_tools(raw)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in raw}
    try:
        grammar = call_grammar(syntax, tools, frozenset(schemas), mode, name, False,
                               token_literals(hf.get_added_vocab()))
    except UnsupportedCallFormat:
        assert mode == "auto" and (syntax.keep_start or syntax.only_at_start)
        return
    constraint = structured.lark(grammar.lark, "tools", grammar.trigger)
    rng = random.Random(hash(fmt) % 1000)
    for _ in range(8):
        tokens, ended = sample_under(tokenizer, constraint.grammar, rng)
        assert ended
        opening = syntax.forced_opening(name) if mode == "forced" else syntax.start
        text = opening + hf.decode(tokens)
        inner = text if syntax.keep_start else text[len(syntax.start):]
        if syntax.end and inner.endswith(syntax.end):
            inner = inner[:-len(syntax.end)]
        calls = parse_calls(syntax, inner, tools)
        assert calls, text
        for call_name, arguments in calls:
            assert name is None or call_name == name
            jsonschema.validate(json.loads(arguments), schemas[call_name])


def test_json_schema_name_and_strict_have_their_declared_types():
    """Schemathesis found them accepted with any type while /openapi.json declares a string
    and a boolean."""
    schema = {"type": "object"}
    for bad in ({"name": True}, {"strict": "yes"}):
        error = error_of(structured.openai_response_format,
                         {"type": "json_schema", "json_schema": {"schema": schema, **bad}})
        assert error.status == 400 and error.code == "invalid_type"
        error = error_of(structured.responses_text_format,
                         {"type": "json_schema", "schema": schema, **bad})
        assert error.status == 400
    assert structured.openai_response_format({"type": "json_schema", "json_schema": {
        "schema": schema, "name": None, "strict": True}}).grammar
