"""JSON Schema of the request models, for /openapi.json (gateway/api/openapi.py).

msgspec states each model's shape; here that is made one self-contained schema per request
(every `$ref` inlined: a request's schema is read alone, by clients and tests), with what
msgspec cannot say added from each struct's `schema_rules(schema)` (given the `Schema` being
made): a member a struct requires though its Python type lets it be absent, an
if/then between members, what depends on the served model (its vocabulary), a member the
gateway fills in before decoding (`optional`), and members that are read but not published
(`unpublished`). Image content is declared only for a model that
takes images (`image = True` on its struct).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from switchyard.gateway.request.wire.base import Model

_DROPPED = ("title", "default", "discriminator")  # msgspec's annotations, and refs it maps


@functools.lru_cache(maxsize=64)
def request_schema(model: type[Model], *, images: bool = False, vocab_size: int = 2**31
                   ) -> dict[str, Any]:
    """The schema of one request model, self-contained. Made once per served model (tens of
    milliseconds: never per /openapi.json request); callers must not change it."""
    return Schema(images, vocab_size).of(model)


class Schema:
    """The schemas of one /openapi.json: whether the model takes images, its vocabulary."""

    def __init__(self, images: bool, vocab_size: int) -> None:
        self.images = images
        self.vocab_size = vocab_size

    def of(self, tp: Any) -> dict[str, Any]:
        (root,), components = msgspec.json.schema_components([tp], ref_template="{name}")
        return _Inliner(self, components, _structs_of(tp)).expand(root)


def _structs_of(tp: Any) -> dict[str, type]:
    """Every Struct `tp` reaches, by the name msgspec gives its component."""
    found: dict[str, type] = {}
    for info in _walk(msgspec.inspect.type_info(tp)):
        if isinstance(info, msgspec.inspect.StructType):
            if found.setdefault(info.cls.__name__, info.cls) is not info.cls:
                raise TypeError(f"two structs named {info.cls.__name__} in one request")
    return found


def _walk(info: Any, seen: set[int] | None = None) -> list[Any]:
    seen = set() if seen is None else seen
    if id(info) in seen:
        return []
    seen.add(id(info))
    out = [info]
    children = []
    if isinstance(info, msgspec.inspect.StructType):
        children = [f.type for f in info.fields]
    elif isinstance(info, msgspec.inspect.UnionType):
        children = list(info.types)
    elif isinstance(info, msgspec.inspect.DictType):
        children = [info.key_type, info.value_type]
    elif hasattr(info, "item_type"):
        children = [info.item_type]
    elif isinstance(info, msgspec.inspect.Metadata):
        children = [info.type]
    for child in children:
        out += _walk(child, seen)
    return out


class _Inliner:
    def __init__(self, schema: Schema, components: dict[str, Any],
                 classes: dict[str, type]) -> None:
        self.schema = schema
        self.components = components
        self.classes = classes

    def expand(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.expand(v) for v in node if self.schema.images or not self._image(v)]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return self.expand(self._component(node["$ref"]))
        out = {k: self.expand(v) for k, v in node.items() if k not in _DROPPED}
        # A field that states its own schema over msgspec's union: integer() (int | float,
        # stated as an integer), and a class-or-integer priority (stated as oneOf).
        if out.get("type") == "integer" or "oneOf" in out:
            out.pop("anyOf", None)
        return out

    def _image(self, node: Any) -> bool:
        return isinstance(node, dict) and "$ref" in node \
            and getattr(self.classes.get(node["$ref"]), "image", False)

    def _component(self, name: str) -> dict[str, Any]:
        schema = dict(self.components[name])
        rules = self.classes[name].schema_rules(self.schema) if name in self.classes else {}
        for key, value in rules.items():
            if key == "required":
                schema["required"] = sorted(set(schema.get("required", ())) | set(value))
            elif key == "properties":
                schema["properties"] = {**schema.get("properties", {}), **value}
            elif key == "optional":
                schema["required"] = [k for k in schema.get("required", ()) if k not in value]
            elif key == "unpublished":
                schema["properties"] = {k: v for k, v in schema["properties"].items()
                                        if k not in value}
            else:
                schema[key] = value
        return schema
