"""JSON Schema of the request models, for /openapi.json (gateway/api/openapi.py).

msgspec states each model's shape; here that is made one self-contained schema per request
(every `$ref` inlined: a request's schema is read alone, by clients and tests), with what
msgspec cannot say added from the model's `schema_rules` (a member a struct requires though
its Python type lets it be absent, an if/then between members). Image content is declared
only for a model that takes images (`image = True` on its struct).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from switchyard.gateway.api.models.base import Model

_DROPPED = ("title", "default", "discriminator")  # msgspec's annotations, and refs it maps


def request_schema(model: type[Model], *, images: bool = False) -> dict[str, Any]:
    """The schema of one request model, self-contained."""
    _, components = msgspec.json.schema_components([model], ref_template="{name}")
    return _Inliner(components, images).expand({"$ref": model.__name__})


def type_schema(tp: Any) -> dict[str, Any]:
    """The schema of one field type (a shared option such as `common.Temperature`)."""
    schema, components = msgspec.json.schema_components([tp], ref_template="{name}")
    return _Inliner(components, images=False).expand(schema[0])


@functools.cache
def _model_classes() -> dict[str, type]:
    found, stack = {}, [Model]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


class _Inliner:
    def __init__(self, components: dict[str, Any], images: bool) -> None:
        self.components = components
        self.images = images
        self.classes = _model_classes()

    def expand(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.expand(v) for v in node if self.images or not self._is_image(v)]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return self.expand(self._component(node["$ref"]))
        out = {k: self.expand(v) for k, v in node.items() if k not in _DROPPED}
        if out.get("type") == "integer":  # integer(): int | float, stated as an integer
            out.pop("anyOf", None)
        return out

    def _is_image(self, node: Any) -> bool:
        return isinstance(node, dict) and "$ref" in node \
            and getattr(self.classes.get(node["$ref"]), "image", False)

    def _component(self, name: str) -> dict[str, Any]:
        schema = dict(self.components[name])
        rules = getattr(self.classes.get(name), "schema_rules", None) or {}
        for key, value in rules.items():
            if key == "required":
                schema["required"] = sorted(set(schema.get("required", ())) | set(value))
            elif key == "properties":
                schema["properties"] = {**schema.get("properties", {}), **value}
            else:
                schema[key] = value
        return schema
