"""``lw.Client(url).encode(...)``: call a layerwise service and get numpy arrays back.

Importing this module needs the standard library only; numpy is imported when a response is decoded.

Example::

    >>> import layerwise as lw
    >>> client = lw.Client("http://127.0.0.1:8000")                                   # doctest: +SKIP
    >>> client.encode(["I love Paris"], layers="-4:", combine="concat", pool="mean").shape   # doctest: +SKIP
    (1, 1536)
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import InputError, ServiceError

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import numpy as np


_DTYPES = {"float16": "float16", "int8": "int8", "uint8": "uint8", "binary": "int8", "ubinary": "uint8"}


def _unpack(obj: Any) -> "np.ndarray":
    """A ``/v1/encode`` array: base64 values of the precision named by ``dtype``, or JSON numbers (float32)."""
    import numpy as np

    if isinstance(obj, dict):
        dtype = np.dtype(_DTYPES.get(obj["dtype"], np.float32)).newbyteorder("<")
        flat = np.frombuffer(base64.b64decode(obj["base64"]), dtype=dtype)
        return flat.reshape(obj["shape"]).astype(dtype.newbyteorder("="))
    return np.asarray(obj, dtype=np.float32)


def _jsonable(value: Any) -> Any:
    """``json.dumps``' fallback: numpy (and torch) scalars and arrays become Python ints, floats and lists, e.g.
    ``layers=np.int64(-1)`` or ``weights=np.array([...], dtype=np.float32)``; anything else is an :class:`InputError`.
    """
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalar / ndarray, torch tensor
        return value.tolist()
    if hasattr(value, "__index__"):
        return value.__index__()
    if hasattr(value, "__float__") and not isinstance(value, (str, bytes)):
        return float(value)
    raise InputError(
        f"an option of type {type(value).__name__} ({value!r:.60}) cannot be sent to the service as JSON; give "
        f"ints, floats, strings or lists of them (e.g. layers=-1, layers=[0, 6], weights=[0.5, 0.5])"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _texts(texts: Iterable[str]) -> list[str]:
    """``texts`` as a list of strings; a bare string (which would be encoded character by character) or bytes is an
    :class:`InputError`, as is an item that is not a string (naming its index)."""
    if isinstance(texts, str):
        raise InputError(
            f"texts is a single string ({_short(texts)}); Client.encode takes a list of texts and would encode "
            f"each character of a string as a text of its own: pass a list: encode([{_short(texts)}])"
        )
    if isinstance(texts, (bytes, bytearray)):
        raise InputError(
            f"texts is {type(texts).__name__} ({_short(texts)}); Client.encode takes a list of str texts: decode "
            f"it and pass a list: encode([data.decode('utf-8')])"
        )
    if isinstance(texts, dict) or not isinstance(texts, Iterable):
        raise InputError(
            f"texts must be a list of strings, got {type(texts).__name__}: pass a list: encode(['I love Paris'])"
        )
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            hint = " (decode it: text.decode('utf-8'))" if isinstance(text, (bytes, bytearray)) else ""
            raise InputError(f"text {i} must be a string, got {type(text).__name__}: {_short(text)}{hint}")
    return out


def _word_lists(words: Iterable[Sequence[str]]) -> list[list[str]]:
    """``words`` as a list of word lists; a bare string or a flat list of strings is an :class:`InputError`."""
    example = "encode_words([['EU', 'rejects', 'German', 'call']])"
    if isinstance(words, (str, bytes, bytearray)):
        split = f"encode_words([{_short(words.split())}])" if isinstance(words, str) else example
        raise InputError(
            f"words must be a list of word lists, got a single {type(words).__name__} ({_short(words)}); pass a "
            f"list with one list of words per text: {split} (or encode([text], level='word') to split on spaces)"
        )
    if isinstance(words, dict) or not isinstance(words, Iterable):
        raise InputError(f"words must be a list of word lists, got {type(words).__name__}; e.g. {example}")
    out = list(words)
    if out and all(isinstance(w, str) for w in out):
        raise InputError(
            f"words must be a list of word lists, got a list of strings ({_short(out)}); wrap it for one text: "
            f"encode_words([{_short(out)}])"
        )
    lists: list[list[str]] = []
    for i, item in enumerate(out):
        if isinstance(item, (str, bytes, bytearray, dict)) or not isinstance(item, Iterable):
            raise InputError(
                f"words must be a list of word lists: item {i} is a {type(item).__name__} ({_short(item)}), not a "
                f"list of words; e.g. {example}"
            )
        item = list(item)
        for j, word in enumerate(item):
            if not isinstance(word, str):
                raise InputError(f"word {j} of item {i} must be a string, got {type(word).__name__}: {_short(word)}")
        lists.append(item)
    return lists


class Client:
    """A small client for ``layerwise serve``. ``timeout`` in seconds per call."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 60.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body, default=_jsonable).encode("utf-8")
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                detail = json.loads(exc.read()).get("detail")
            except Exception:  # noqa: BLE001 - the body may not be JSON
                detail = exc.reason
            raise ServiceError(exc.code, detail) from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, unknown host, timed out
            reason = getattr(exc, "reason", exc)
            raise ServiceError(
                0, f"could not reach the layerwise service at {self.url} ({reason}); is `layerwise serve` running "
                   f"there? (timeout {self.timeout} s)"
            ) from exc

    def model(self) -> dict:
        """``GET /v1/model``: the model's name, layers, hidden size, sites and the service limits."""
        return self._call("GET", "/v1/model")

    def health(self) -> bool:
        """``GET /health``: whether the service answers ``{"status": "ok"}``."""
        return self._call("GET", "/health").get("status") == "ok"

    def encode(
        self,
        texts: Sequence[str],
        *,
        layers: int | str | Sequence[int | str] = -1,
        site: str = "block",
        combine: str = "concat",
        weights: Sequence[float] | None = None,
        pool: str | None = "mean",
        level: str = "sentence",
        subword: str | None = None,
        skip_special_tokens: bool = False,
        truncate: bool = False,
        normalize: bool = False,
        prompt: str = "",
        add_eos: bool = False,
        output_dtype: str = "float32",
        dimensions: int | None = None,
        calibration: Any = None,
    ) -> Any:
        """Encode ``texts`` (a list of strings) with the fields of an ``EncodeSpec``.

        ``layers``, ``site``, ``combine``, ``weights``, ``pool``, ``level``, ``subword``, ``skip_special_tokens``,
        ``truncate``, ``normalize``, ``prompt``, ``add_eos``, ``output_dtype`` and ``dimensions`` are as in
        :class:`~layerwise.EncodeSpec` and :meth:`Extractor.encode <layerwise.Extractor.encode>` (``pool`` default
        ``mean``; ``pool=None`` means token vectors, as it does for ``Extractor.encode``; ``subword`` ``first``); numpy
        ints and floats are accepted (``layers=np.int64(-1)``).

        Args:
            texts: a list of strings; a bare string is refused (it would be encoded character by character).
            calibration: ``int8``/``uint8`` ranges ``(min, max)`` (``spec.calibration`` of a calibrated spec).

        Returns:
            Sentence level: ``[n, D]``; token level (or ``pool=None``) and word level: a list of ``[n_i, D]`` arrays.

        Raises:
            InputError: ``texts`` is not a list of strings (checked before any request).
            ServiceError: the service refused the request (status and detail) or could not be reached (status 0).
        """
        if pool is None and level == "sentence":  # Extractor.encode's meaning: no pool, the token vectors
            level = "token"
        body: dict[str, Any] = {"texts": _texts(texts), "layers": layers, "site": site, "combine": combine,
                                "level": level, "truncate": truncate, "output_dtype": output_dtype,
                                "encoding": "base64"}
        # options at their defaults are left out, so a service of an older layerwise still takes the request
        optional = {"weights": weights, "pool": None if pool == "mean" else pool, "subword": subword,
                    "skip_special_tokens": skip_special_tokens or None, "normalize": normalize or None,
                    "prompt": prompt or None, "add_eos": add_eos or None, "dimensions": dimensions,
                    "calibration": None if calibration is None else {"min": list(calibration[0]),
                                                                     "max": list(calibration[1])}}
        body.update({k: v for k, v in optional.items() if v is not None})
        out = self._call("POST", "/v1/encode", body)
        if level == "sentence":
            return _unpack(out["vectors"])
        return [_unpack(v) for v in out["vectors"]]

    def encode_words(
        self,
        words: Sequence[Sequence[str]],
        *,
        layers: int | str | Sequence[int | str] = -1,
        site: str = "block",
        combine: str = "concat",
        weights: Sequence[float] | None = None,
        subword: str | None = None,
        truncate: bool = False,
        add_eos: bool = False,
        output_dtype: str = "float32",
    ) -> list[np.ndarray]:
        """One vector per word of pre-tokenised input (level ``word``): a list of ``[n_words_i, D]`` arrays.

        Raises:
            InputError: ``words`` is a bare string or a list of strings instead of a list of word lists (checked
                before any request).
            ServiceError: the service refused the request or could not be reached (status 0).
        """
        body: dict[str, Any] = {"words": _word_lists(words), "layers": layers, "site": site,
                                "combine": combine, "level": "word", "truncate": truncate, "output_dtype": output_dtype,
                                "encoding": "base64"}
        optional = {"weights": weights, "subword": subword, "add_eos": add_eos or None}
        body.update({k: v for k, v in optional.items() if v is not None})
        out = self._call("POST", "/v1/encode", body)
        return [_unpack(v) for v in out["vectors"]]
