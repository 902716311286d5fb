"""What JSON Schema cannot state about a request, applied to schemathesis' generated ones.

A named tool_choice must name one of `tools`, the grammar of the tools' calls stays within its
bound, each tool's parameter schema is one the grammar compiler takes, and a function is offered once (a Responses
namespace's included); a previous_response_id must be one the server
still keeps; an image's bytes must be an image (and at most --max-images of them). The published
spec documents each as a 400 (gateway/api/openapi.py `_SEMANTIC_400S`); a valid generated case
is made to follow them before it is sent: by tests/integration/test_openapi_schemathesis.py, and
by the schemathesis CLI through tests/helpers/schemathesis_hooks.py.
"""

from __future__ import annotations

import base64
import io
import json

MAX_IMAGES = 16
# The call grammar made from the tools is bounded (64 KiB, a 400 beyond it); a list within
# these stays well inside it.
MAX_TOOLS_IN_GRAMMAR = 64
MAX_TOOLS_JSON = 16 * 1024


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (200, 60, 10)).save(buf, "PNG")
    return buf.getvalue()


PNG_BASE64 = base64.b64encode(_png()).decode()
PNG_URL = "data:image/png;base64," + PNG_BASE64


def make_images_real(value, seen: list[int]) -> object:
    """Every generated image part holds a real PNG (as a data URL or base64 source); past
    MAX_IMAGES in a request, an image part becomes a text part."""
    if isinstance(value, list):
        return [make_images_real(v, seen) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get("type")
    image = (kind == "image_url" and "image_url" in value) or (
        kind == "input_image" and "image_url" in value) or (kind == "image" and "source" in value)
    if image:
        seen[0] += 1
        if seen[0] > MAX_IMAGES:
            return {"type": "input_text" if kind == "input_image" else "text", "text": "x"}
        if kind == "image_url":
            if isinstance(value["image_url"], dict):
                return {**value, "image_url": {**value["image_url"], "url": PNG_URL}}
            return {**value, "image_url": PNG_URL}
        if kind == "input_image":
            return {**value, "image_url": PNG_URL}
        return {**value, "source": {"type": "base64", "media_type": "image/png",
                                    "data": PNG_BASE64}}
    return {k: make_images_real(v, seen) for k, v in value.items()}


def follow_unstateable_rules(body) -> None:
    if not isinstance(body, dict):
        return
    body.pop("previous_response_id", None)
    for key in ("messages", "input"):
        if key in body:
            body[key] = make_images_real(body[key], [0])
    names = []
    tools = body.get("tools")
    if isinstance(tools, list):  # the grammar of their calls must stay within 64 KiB
        while len(tools) > 1 and (len(tools) > MAX_TOOLS_IN_GRAMMAR
                                  or len(json.dumps(tools)) > MAX_TOOLS_JSON):
            tools.pop()
    for tool in _offered(tools):
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom", "function"):
            continue  # a server tool: skipped, not callable
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            if function["name"] in names:  # a function offered twice is a 400
                function["name"] += f"_{len(names)}"
            names.append(function["name"])
        if isinstance(function, dict):
            for key in SCHEMA_KEYS:
                if key in function and not _compiles(function[key]):
                    function[key] = {"type": "object"}
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and names:
        if isinstance(choice.get("function"), dict):
            choice["function"]["name"] = names[0]
        elif "name" in choice:
            choice["name"] = names[0]


# Where each API's tool holds its parameters' JSON Schema (Chat's `function.parameters`,
# Responses' `parameters`, Messages' `input_schema`).
SCHEMA_KEYS = ("parameters", "input_schema")


def _compiles(schema) -> bool:
    """Whether the grammar compiler takes `schema` as a JSON Schema: a forced call (a strict
    tool, a required or named tool_choice) is a 400 otherwise, which no schema can state (a
    generated `{"minLength": [5, 3]}` is an object like any other)."""
    from switchyard.gateway.errors import APIError
    from switchyard.gateway.request.structured import check_now, json_schema

    try:
        check_now(json_schema(schema, "tools"))
    except APIError:
        return False
    return True


def _offered(tools) -> list:
    """The tools, a Responses namespace's functions in its place."""
    out = []
    for tool in tools if isinstance(tools, list) else ():
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            out += tool.get("tools") if isinstance(tool.get("tools"), list) else []
        else:
            out.append(tool)
    return out
