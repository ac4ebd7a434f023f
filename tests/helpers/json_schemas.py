"""Random JSON schemas from a seed, for the structured-outputs tests.

The schemas mix nested objects (with required and optional properties), enums, arrays, bounded
integers and numbers, booleans, nulls and short strings. Every size is bounded (`maxLength`,
`maxItems`, number ranges, few properties), so the language of each schema is finite and even a
random model reaches its end within a modest `max_tokens`.
"""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["id", "name", "kind", "size", "tags", "ok", "pos", "meta", "items", "score", "x", "y"]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """One random schema; objects and arrays nest up to depth 2."""
    kinds = ["enum", "integer", "number", "boolean", "string", "null"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(_WORDS, rng.randint(1, 3))
        props = {name: random_schema(rng, depth + 1) for name in names}
        required = [n for n in names if rng.random() < 0.7]
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    if kind == "array":
        lo = rng.randint(0, 1)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 2),
        }
    if kind == "enum":
        pool = ["red", "green", "blue", 1, 2.5, True, None, "a b"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 6)}
    return {"type": kind}


def random_object_schema(rng: random.Random) -> dict[str, Any]:
    """A random schema whose top level is an object (what `response_format` asks for)."""
    schema = random_schema(rng)
    while schema.get("type") != "object":
        schema = random_schema(rng)
    return schema
