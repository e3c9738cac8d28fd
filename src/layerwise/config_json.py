"""Configs as JSON: every config object of layerwise (``EncodeSpec``, ``ModelOptions``, ``HeadConfig``) is a frozen
dataclass that round-trips through JSON text or a file with these helpers: one way to write, one way to read (a
missing file or bad JSON is one clear error naming it), one way to build from a dict (names of earlier versions read
as today's, unknown keys refused with the valid ones listed). Imports no torch.

Example::

    >>> from layerwise.config_json import fields_from
    >>> fields_from({"dtype": "float16"}, ["output_dtype"], {"dtype": "output_dtype"}, "EncodeSpec")
    {'output_dtype': 'float16'}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import LayerwiseError


def dump_json(data: dict[str, Any], path: str | Path | None = None) -> str:
    """``data`` as indented JSON text; also written to ``path`` (UTF-8, trailing newline) when given."""
    text = json.dumps(data, indent=2)
    if path is not None:
        Path(path).write_text(text + "\n", encoding="utf-8")
    return text


def read_json_arg(text_or_path: str | Path, what: str, error: type[LayerwiseError] = LayerwiseError) -> Any:
    """JSON from text (starting with ``{``) or from a file; ``error`` naming a missing file or bad JSON."""
    raw = str(text_or_path)
    if raw.lstrip().startswith("{"):
        source, text = "the JSON text", raw
    else:
        path = Path(raw)
        if not path.is_file():
            raise error(f"{what} file {raw!r} does not exist (give a .json file written by layerwise, or JSON text)")
        source, text = repr(raw), path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what}: {source} is not valid JSON ({exc})") from exc


def fields_from(
    data: object, known: Iterable[str], legacy: Mapping[str, str], what: str,
    error: type[LayerwiseError] = LayerwiseError,
) -> dict[str, Any]:
    """The keyword arguments of a config from a JSON object: ``legacy`` names (of layerwise 0.x) read as today's.

    Raises:
        error: ``data`` is not an object, or holds keys that are not fields (naming them and the valid ones).
    """
    if not isinstance(data, dict):
        raise error(f"{what} is a JSON object, got {type(data).__name__}")
    fields = list(known)
    out = {legacy.get(k, k): v for k, v in data.items()}
    unknown = sorted(set(out) - set(fields))
    if unknown:
        raise error(f"unknown {what} field(s) {unknown}; valid fields are: {', '.join(fields)}")
    return out


__all__ = ["dump_json", "fields_from", "read_json_arg"]
