"""The JSON report's schema, and a check of a document against it.

The package depends on no JSON Schema validator (only pytest, pytest-xdist and
psutil), yet the merge command (``python -m pytest_elastic_timer.merge``) refuses a
report that does not match the schema rather than pass its records on. :func:`violations`
checks the keywords the report's schema uses (:data:`KEYWORDS`), as draft 2020-12 reads
them (patterns with Python's ``re``, as the jsonschema package does), and boolean
schemas; a schema with any other keyword is refused, not half checked. This module imports
nothing from pytest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

SCHEMA = "report.schema.json"
# What the report's schema is written with: the keywords checked, and those that only
# describe (annotations, and where the definitions are).
KEYWORDS = frozenset(
    {
        "$ref",
        "type",
        "enum",
        "const",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "pattern",
        "required",
        "properties",
        "additionalProperties",
        "propertyNames",
        "items",
        "if",
        "then",
        "else",
    }
)
ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "title", "description"})


def report_schema() -> dict[str, Any]:
    """The JSON Schema of the JSON report (``--elastic-timer-report``)."""
    text = resources.files("pytest_elastic_timer.core").joinpath(SCHEMA).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


def violations(document: Any, schema: dict[str, Any]) -> list[str]:
    """Where ``document`` does not match ``schema`` (a ``$ref`` is resolved in
    ``schema`` itself), each as ``path: what``; ``[]`` when it matches."""
    return list(_check(document, schema, schema, "$"))


def _check(value: Any, schema: Any, root: dict[str, Any], at: str) -> Iterator[str]:
    if schema is True:
        return
    if schema is False:
        yield f"{at}: not allowed"
        return
    unknown = set(schema) - KEYWORDS - ANNOTATIONS
    if unknown:
        raise ValueError(f"schema keyword(s) not supported at {at}: {sorted(unknown)}")
    if "$ref" in schema:
        yield from _check(value, _resolve(schema["$ref"], root), root, at)
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, name) for name in types):
            yield f"{at}: {value!r:.80} is not of type {' or '.join(types)}"
            return  # the other keywords would only say it again
    if "enum" in schema and not any(_same(value, v) for v in schema["enum"]):
        yield f"{at}: {value!r:.80} is not one of {schema['enum']}"
    if "const" in schema and not _same(value, schema["const"]):
        yield f"{at}: {value!r:.80} is not {schema['const']!r}"
    if _is(value, "number"):
        yield from _bounds(value, schema, at)
    # Python's re, as the jsonschema package reads patterns (a "$" also matches before
    # a last newline, where ECMA-262's does not): both accept the same reports.
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        yield f"{at}: {value!r:.80} does not match {schema['pattern']!r}"
    if isinstance(value, dict):
        yield from _object(value, schema, root, at)
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from _check(item, schema["items"], root, f"{at}[{index}]")
    if "if" in schema:
        matches = not any(True for _ in _check(value, schema["if"], root, at))
        branch = schema.get("then" if matches else "else")
        if branch is not None:
            yield from _check(value, branch, root, at)


def _bounds(value: float, schema: dict[str, Any], at: str) -> Iterator[str]:
    if "minimum" in schema and value < schema["minimum"]:
        yield f"{at}: {value!r} is less than {schema['minimum']}"
    if "maximum" in schema and value > schema["maximum"]:
        yield f"{at}: {value!r} is more than {schema['maximum']}"
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        yield f"{at}: {value!r} is not more than {schema['exclusiveMinimum']}"


def _object(
    value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], at: str
) -> Iterator[str]:
    for name in schema.get("required", ()):
        if name not in value:
            yield f"{at}: {name!r} is missing"
    properties: dict[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    names = schema.get("propertyNames")
    for name, item in value.items():
        where = f"{at}.{name}"
        if names is not None:
            yield from _check(name, names, root, f"{where} (name)")
        if name in properties:
            yield from _check(item, properties[name], root, where)
        elif extra is False:
            yield f"{at}: {name!r} is not allowed"
        elif isinstance(extra, dict):
            yield from _check(item, extra, root, where)


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#/"):
        raise ValueError(f"only references within the schema are supported: {ref!r}")
    found: Any = root
    for part in ref[2:].split("/"):
        found = found[part]
    if not isinstance(found, dict):
        raise ValueError(f"{ref!r} is not a schema")
    return found


def _is(value: Any, name: str) -> bool:
    """Whether ``value`` is of JSON type ``name`` (a bool is no number; 1.0 is an
    integer, as draft 2020-12 has it)."""
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float))
    kinds: dict[str, type] = {"string": str, "array": list, "object": dict}
    return isinstance(value, kinds[name])


def _same(value: Any, other: Any) -> bool:
    """JSON equality: ``True`` is not ``1``."""
    return value == other and isinstance(value, bool) == isinstance(other, bool)
