"""The service's rules, stated in its OpenAPI document: what a request may hold on this model, so that a client (or a
schema-driven tester such as schemathesis) never sends a schema-valid body that the service then refuses.

Pydantic's models say each field's type; :func:`state_rules` adds what depends on the served model or on another
field:

* ``site``: one of the sites recorded for this model (:attr:`Extractor.sites <layerwise.Extractor.sites>`);
* ``combine`` and ``pool``: the fixed modes (a learned one needs trained weights the service does not hold);
* ``subword``: the word-pooling modes;
* TEI's ``truncation_direction``: ``Right`` only (layerwise keeps an input's start; ``Left`` is refused, saying so);
* cross-field, as ``if``/``then`` (JSON Schema, OpenAPI 3.1): ``words`` needs ``level: "word"``; ``calibration``
  goes with ``output_dtype`` ``int8`` or ``uint8``, both ways; ``weights`` with ``combine: "weighted"``, both ways;
  ``pool`` needs ``level: "sentence"``; ``pool`` ``cls`` or ``pooler`` cannot go with ``skip_special_tokens``; no
  ``prompt`` at ``level: "word"``.

What a schema cannot say stays a refusal with its reason: a ``weights`` list must hold one weight per selected layer,
and a layer spec's indices must exist (``tests/serve/schemathesis.toml`` lists these, operation by operation).

Example::

    >>> doc = {"components": {"schemas": {"R": {"properties": {"site": {"type": "string"}}}}}}
    >>> state_rules(doc, sites=["block", "raw"])["components"]["schemas"]["R"]["properties"]["site"]["enum"]
    ['block', 'raw']
"""

from __future__ import annotations

from typing import Any, Sequence

from ..encoding.vocab import FIXED_COMBINES, FIXED_POOLS, WORD_POOL_MODES

TRUNCATION_DIRECTIONS = ["Right", "right"]


def _enum(prop: dict[str, Any], values: Sequence[str]) -> None:
    """Narrow ``prop`` (a string, or a string or null) to ``values``."""
    options = prop.get("anyOf")
    if options:
        for option in options:
            if option.get("type") == "string":
                option["enum"] = list(values)
    elif prop.get("type") == "string":
        prop["enum"] = list(values)


def _given(field: str, kind: str | None = None) -> dict[str, Any]:
    """``if`` of a rule: ``field`` is present and not null (of JSON type ``kind`` where given)."""
    inner: dict[str, Any] = {"type": kind} if kind else {"not": {"type": "null"}}
    return {"properties": {field: inner}, "required": [field]}


def _rule(when: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    return {"if": when, "then": then}


def _cross_field(props: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``if``/``then`` rules among the fields of one request body ``props``."""
    rules = []
    if "words" in props and "level" in props:
        rules.append(_rule(_given("words", "array"),
                           {"properties": {"level": {"const": "word"}}, "required": ["level"]}))
    if "calibration" in props and "output_dtype" in props:
        rules.append(_rule(_given("calibration", "object"),
                           {"properties": {"output_dtype": {"enum": ["int8", "uint8"]}}, "required": ["output_dtype"]}))
        rules.append(_rule({"properties": {"output_dtype": {"enum": ["int8", "uint8"]}}, "required": ["output_dtype"]},
                           {"properties": {"calibration": {"type": "object"}}, "required": ["calibration"]}))
    if "weights" in props and "combine" in props:
        rules.append(_rule(_given("weights", "array"),
                           {"properties": {"combine": {"const": "weighted"}}, "required": ["combine"]}))
        rules.append(_rule({"properties": {"combine": {"const": "weighted"}}, "required": ["combine"]},
                           {"properties": {"weights": {"type": "array"}}, "required": ["weights"]}))
    if "pool" in props and "level" in props:
        rules.append(_rule(_given("pool", "string"), {"properties": {"level": {"const": "sentence"}}}))
    if "prompt" in props and "level" in props:
        rules.append(_rule({"properties": {"level": {"const": "word"}}, "required": ["level"]},
                           {"properties": {"prompt": {"enum": ["", None]}}}))
    if "pool" in props and "skip_special_tokens" in props:
        rules.append(_rule({"properties": {"pool": {"enum": ["cls", "pooler"]}}, "required": ["pool"]},
                           {"properties": {"skip_special_tokens": {"enum": [False, None]}}}))
    return rules


def state_rules(doc: dict[str, Any], sites: Sequence[str]) -> dict[str, Any]:
    """``doc`` (an OpenAPI document) with the rules of the module docstring stated in every request body of its
    components; returns ``doc``."""
    for schema in doc.get("components", {}).get("schemas", {}).values():
        props = schema.get("properties")
        if not isinstance(props, dict):
            continue
        for name, values in (("site", sites), ("combine", FIXED_COMBINES), ("pool", FIXED_POOLS),
                             ("subword", WORD_POOL_MODES), ("truncation_direction", TRUNCATION_DIRECTIONS)):
            if name in props:
                _enum(props[name], values)
        weights = props.get("weights", {})
        for option in weights.get("anyOf", [weights]):
            if option.get("type") == "array":
                option["minItems"] = 1  # one weight per selected layer: at least one
        rules = _cross_field(props)
        if rules:
            schema.setdefault("allOf", []).extend(rules)
    return doc


__all__ = ["TRUNCATION_DIRECTIONS", "state_rules"]
