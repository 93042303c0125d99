"""Structured output fields (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``) as a guide.

The server compiles and applies the guide (``speculative_decoding``'s
``guided_decoding_guide_type`` / ``guided_decoding_guide``, :mod:`specdec.grammar`); this
module only picks it from the request. A request may give one guide; a guide the server
cannot compile comes back as a 400 naming the field it came from
(:func:`name_guide_field`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from specdec_openai.protocol import Plan, RequestError

ANY_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")  # vLLM's older extras
# structured_outputs' keys -> (the server's guide type, how the value becomes the guide)
_STRUCTURED_KEYS = ("json", "regex", "grammar", "choice", "json_object")


@dataclass(frozen=True)
class Guide:
    guide_type: str  # json_schema, regex or ebnf_grammar (the server's guide types)
    guide: str
    field: str  # the request's field it came from, named in errors


def guide_of(request: Any) -> Guide | None:
    """The request's one guide, or None; a malformed or second guide is refused naming its field."""
    found = []
    response_format = getattr(request, "response_format", None)
    if response_format:
        guide = _response_format(response_format)
        found += [guide] if guide is not None else []
    for name in GUIDED_FIELDS:
        value = getattr(request, name, None)
        if value is not None:
            found.append(_guide(name[len("guided_"):], value, name))
    structured = getattr(request, "structured_outputs", None)
    if structured:
        given = [key for key in _STRUCTURED_KEYS if structured.get(key) not in (None, False)]
        unknown = sorted(set(structured) - set(_STRUCTURED_KEYS))
        if unknown:
            raise RequestError(f"'structured_outputs' takes {', '.join(_STRUCTURED_KEYS)}; got {unknown}",
                               "structured_outputs")  # fmt: skip
        found += [_guide(key, structured[key], "structured_outputs") for key in given]
    if len(found) > 1:
        raise RequestError(f"give one structured output guide, got {len(found)} (from "
                           f"{', '.join(g.field for g in found)})", found[1].field)  # fmt: skip
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> Guide | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_schema", ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("'response_format' of type json_schema needs 'json_schema': {'name': ..., 'schema': "
                               "{...}}, the schema a JSON object", "response_format")  # fmt: skip
        return Guide("json_schema", json.dumps(schema), "response_format")
    raise RequestError(f"'response_format' type must be text, json_object or json_schema, got {kind!r}",
                       "response_format")  # fmt: skip


def _guide(key: str, value: Any, field: str) -> Guide:
    if key == "json_object":
        return Guide("json_schema", ANY_OBJECT, field)
    if key == "json":
        if isinstance(value, str):
            return Guide("json_schema", value, field)
        if isinstance(value, dict):
            return Guide("json_schema", json.dumps(value), field)
    elif key in ("regex", "grammar") and isinstance(value, str) and value:
        return Guide("regex" if key == "regex" else "ebnf_grammar", value, field)
    elif key == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return Guide("ebnf_grammar", "root ::= " + " | ".join(json.dumps(c) for c in value), field)
    wanted = {"json": "a JSON schema (an object or its text)", "regex": "a non-empty string",
              "grammar": "a non-empty EBNF string", "choice": "a non-empty list of strings"}[key]  # fmt: skip
    raise RequestError(f"'{field}' {key} must be {wanted}", field)


def with_guide(plan: Plan, request: Any, tools: Guide | None = None) -> tuple[Plan, Guide | None]:
    """``plan`` with the request's guide in every choice, and the guide (for :func:`name_guide_field`);
    ``tools``: the guide of its tool calls (:mod:`specdec_openai.tools`), which excludes any other."""
    guide = guide_of(request)
    if tools is not None and guide is not None:
        raise RequestError(f"'{guide.field}' cannot be combined with 'tools' (tool_choice other than 'none'): the "
                           "tool calls are constrained by a guide of their own", guide.field)  # fmt: skip
    guide = guide or tools
    if guide is None:
        return plan, None
    choices = tuple(replace(c, guide_type=guide.guide_type, guide=guide.guide) for c in plan.choices)
    return replace(plan, choices=choices), guide


def name_guide_field(err: RequestError, guide: Guide | None) -> RequestError:
    """The server's refusal of a guide (it names ``guided_decoding_guide``) as the request's field's."""
    if guide is None or err.param is not None or "guided_decoding_guide" not in err.message:
        return err
    return RequestError(f"'{guide.field}': {err.message}", guide.field, err.status, err.code)
