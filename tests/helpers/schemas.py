"""Random JSON schemas whose every instance is short, for structured-output property tests.

Every string has a maxLength, every integer a range, every array a maxItems and every object
`additionalProperties: false`, so a constrained output of any model ends within a bounded number
of tokens (compact JSON: no whitespace runs).
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["alpha", "beta", "gamma", "delta", "x", "y-z", "north", "south"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["integer", "string", "boolean", "null", "enum", "const", "pattern"]
    if depth < 2:
        kinds += ["array", "object", "object", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    if kind == "pattern":
        return {"type": "string", "pattern": "^[a-f0-9]{2,5}$"}
    if kind == "array":
        lo = rng.randint(0, 1)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    names = rng.sample(["id", "name", "tags", "ok", "count", "meta", "kind"], rng.randint(1, 3))
    return {"type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7],
            "additionalProperties": False}


def random_object_schema(rng: random.Random) -> dict[str, Any]:
    """A schema for tool arguments and response formats: always an object at the top."""
    schema = random_schema(rng, 1)
    while schema.get("type") != "object":
        schema = random_schema(rng, 1)
    return schema
