"""Seeded JSON-schema generator for structured-output tests: nested objects, arrays,
enums, bounded numbers and strings, nullable unions, required and optional keys."""

from __future__ import annotations

import random


def gen_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array", "object", "null_union"]
    if depth >= 2:
        kinds = kinds[:5]
    kind = rng.choice(kinds)
    if kind == "string":
        s = {"type": "string", "maxLength": rng.randint(1, 12)}
        if rng.random() < 0.3:
            s["minLength"] = 1
        return s
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "x y"], rng.randint(1, 4))}
    if kind == "array":
        return {
            "type": "array",
            "items": gen_schema(rng, depth + 1),
            "minItems": rng.randint(0, 1),
            "maxItems": rng.randint(1, 3),
        }
    if kind == "null_union":
        return {"anyOf": [gen_schema(rng, depth + 1), {"type": "null"}]}
    return gen_object(rng, depth + 1)


def gen_object(rng: random.Random, depth: int = 0) -> dict:
    n = rng.randint(1, 4)
    names = rng.sample(["id", "name", "age", "tags", "score", "ok", "city", "items", "meta", "when"], n)
    props = {k: gen_schema(rng, depth) for k in names}
    req = [k for k in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}
