"""A corpus of JSON schemas for constrained decoding: nested objects, bounded arrays, enums, numbers with
ranges, optional and required fields, ``anyOf``, strings with patterns. Strings are bounded (maxLength,
a pattern, an enum or a const) so that a tiny random model, which never chooses to close a string, still
finishes within its token budget."""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 8}
SHORT = {"type": "string", "maxLength": 4}
PERSON = {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"]}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["n"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["x"]},
    {"type": "object", "properties": {"t": {"type": "number", "minimum": -40.5, "maximum": 60}}, "required": ["t"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": SHORT, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                           "maximum": 9}, "maxItems": 4}},
     "required": ["xs"]},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [NAME, {"type": "boolean"}],
                                               "items": False, "minItems": 2}}, "required": ["pair"]},
    {"type": "object", "properties": {"owner": PERSON}, "required": ["owner"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2}},
     "required": ["people"]},
    {"type": "object", "properties": {"name": NAME, "nick": SHORT}, "required": ["name"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "note": SHORT,
                                      "done": {"type": "boolean"}}, "required": ["id"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, SHORT]}},
     "required": ["v"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}}, "required": ["v"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["r"]},
        {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "h": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["w", "h"]}]}}, "required": ["shape"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}}, "required": ["kind", "x"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "priority": {
        "type": "integer", "minimum": 1, "maximum": 5}, "labels": {"type": "array", "items": {
            "enum": ["bug", "ui", "perf"]}, "maxItems": 3}}, "required": ["status", "priority", "labels"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 5},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"m": {"type": "object", "properties": {"k": SHORT}, "required": ["k"]},
                                      "n": {"type": "object", "properties": {"k": SHORT}}},
     "required": ["m", "n"]},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["EUR", "USD"]}}, "required": ["price", "currency"]},
    {"type": "object", "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3}$"}},
     "required": ["phone"]},
    {"type": "object", "properties": {"grid": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "minItems": 2, "maxItems": 2}}},
     "required": ["grid"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}, "reason": {"type": "string", "maxLength": 6}},
     "required": ["answer", "confidence"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"enum": ["alpha", "beta", 3, None]},
]
