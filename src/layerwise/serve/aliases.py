"""Aliases: model names that pick an :class:`~layerwise.EncodeSpec`, for clients that can only set ``model``.

``layerwise serve --alias minilm-mid='layers=3;pool=mean' --alias minilm-last4='layers=-4:;combine=concat'`` (or
``--aliases FILE``, a JSON or TOML table ``{name: {field: value}}``) serves the model under those names as well: an
OpenAI request with ``model="minilm-mid"`` gets layer 3, mean-pooled. A request's own extension fields still win.

In the ``NAME='k=v;k=v'`` form, values are read as JSON where they parse (``3``, ``true``, ``[0, 6]``, ``null``),
comma lists of ints as lists (``layers=0,6``), anything else as text (``pool=mean``, ``layers=-4:``).
``calibration=FILE`` gives an ``int8``/``uint8`` alias its ranges: a JSON of ranges, or texts (one a line) that the
service encodes once at start (in an ``--aliases`` file, a relative path is relative to that file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from ..encoding.precision import read_calibration
from ..encoding.spec import EncodeSpec
from ..errors import LayerwiseError, SpecError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def _value(text: str) -> Any:
    text = text.strip()
    if re.fullmatch(r"-?\d+(,-?\d+)+", text):
        return [int(x) for x in text.split(",")]
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_alias(text: str) -> tuple[str, dict[str, Any]]:
    """``'NAME=k=v;k=v'`` -> ``(NAME, {k: v})`` (the fields are checked as an :class:`~layerwise.EncodeSpec`).

    Raises:
        SpecError: no ``=``, a bad name, a field that is not ``k=v``, or fields that are not a valid spec.
    """
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not _NAME.match(name):
        raise SpecError(f"--alias {text!r}: give NAME='field=value;field=value', e.g. --alias "
                        f"minilm-mid='layers=3;pool=mean' (a name of letters, digits and ._:/-)")
    fields: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.strip().strip("'\"").split(";"))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            fields_list = ", ".join(f.name for f in dataclasses.fields(EncodeSpec))
            raise SpecError(f"--alias {name}: {part!r} is not field=value (fields: {fields_list})")
        fields[key.strip()] = _value(value)
    return name, check_fields(name, fields)


def check_fields(name: str, fields: Any) -> dict[str, Any]:
    """``fields`` after checking they make a valid :class:`~layerwise.EncodeSpec` (not yet against a model).

    ``calibration`` may name a file (texts, or ranges as JSON): it must exist; the service reads it at start.
    """
    if not isinstance(fields, dict):
        raise SpecError(f"alias {name!r}: give a table of spec fields, got {fields!r}")
    try:
        given = dict(fields)
        if isinstance(given.get("calibration"), str):
            read_calibration(given["calibration"])  # a missing or malformed file is named now
            given["calibration"] = None
        EncodeSpec.from_dict(given)
    except (LayerwiseError, TypeError) as exc:
        raise SpecError(f"alias {name!r}: {exc}") from exc
    return dict(fields)


def load_aliases(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The aliases of a JSON (``.json``) or TOML (any other suffix) file: ``{name: {field: value}}``.

    Raises:
        SpecError: the file does not parse, or an alias is not a valid spec (naming the file and the alias).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import tomllib

            data = tomllib.loads(text)
    except (OSError, ValueError) as exc:
        raise SpecError(f"--aliases {os.fspath(path)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(f"--aliases {os.fspath(path)!r}: give a table {{name: {{field: value}}}}")
    out = {}
    for name, fields in data.items():
        if not _NAME.match(str(name)):
            raise SpecError(f"--aliases {os.fspath(path)!r}: alias name {name!r} is not letters, digits and ._:/-")
        if isinstance(fields, dict) and isinstance(fields.get("calibration"), str):  # relative to the file
            fields = {**fields, "calibration": str(p.parent / Path(fields["calibration"]).expanduser())}
        out[str(name)] = check_fields(str(name), fields)
    return out


__all__ = ["check_fields", "load_aliases", "parse_alias"]
