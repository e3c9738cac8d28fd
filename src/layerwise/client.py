"""``lw.Client(url).encode(...)``: call a layerwise service and get numpy arrays back (standard library only).

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
from typing import Any, Sequence

import numpy as np

from .errors import ServiceError


def _unpack(obj) -> np.ndarray:
    if isinstance(obj, dict):
        dtype = np.dtype(np.float16 if obj["dtype"] == "float16" else np.float32).newbyteorder("<")
        flat = np.frombuffer(base64.b64decode(obj["base64"]), dtype=dtype)
        return flat.reshape(obj["shape"]).astype(dtype.newbyteorder("="))
    return np.asarray(obj, dtype=np.float32)


class Client:
    """A small client for ``layerwise serve``. ``timeout`` in seconds per call."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 60.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode("utf-8")
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

    def model(self) -> dict:
        """``GET /v1/model``: the model's name, layers, hidden size, sites and the service limits."""
        return self._call("GET", "/v1/model")

    def health(self) -> bool:
        return self._call("GET", "/health").get("status") == "ok"

    def encode(
        self,
        texts: Sequence[str],
        *,
        layers: int | str | list[int | str] = -1,
        site: str = "block",
        combine: str = "concat",
        weights: Sequence[float] | None = None,
        pool: str | None = None,
        level: str = "sentence",
        subword: str | None = None,
        skip_special_tokens: bool = False,
        truncate: bool = False,
        output_dtype: str = "float32",
    ) -> Any:
        """Encode ``texts`` with the fields of an ``EncodeSpec`` (``pool`` default ``mean``, ``subword`` ``first``).

        Returns:
            Sentence level: ``[n, D]``; token/word level: a list of ``[n_i, D]`` arrays. Raises :class:`ServiceError`.
        """
        body: dict[str, Any] = {"texts": list(texts), "layers": layers, "site": site, "combine": combine,
                                "level": level, "truncate": truncate, "output_dtype": output_dtype,
                                "encoding": "base64"}
        optional = {"weights": weights, "pool": pool, "subword": subword,
                    "skip_special_tokens": skip_special_tokens or None}
        body.update({k: v for k, v in optional.items() if v is not None})
        out = self._call("POST", "/v1/encode", body)
        if level == "sentence":
            return _unpack(out["vectors"])
        return [_unpack(v) for v in out["vectors"]]

    def encode_words(
        self,
        words: Sequence[Sequence[str]],
        *,
        layers: int | str | list[int | str] = -1,
        site: str = "block",
        combine: str = "concat",
        weights: Sequence[float] | None = None,
        subword: str | None = None,
        truncate: bool = False,
        output_dtype: str = "float32",
    ) -> list[np.ndarray]:
        """One vector per word of pre-tokenised input (level ``word``): a list of ``[n_words_i, D]`` arrays.

        Raises :class:`ServiceError`; a bare string or a list of strings is refused (give lists of words).
        """
        if isinstance(words, str) or any(isinstance(w, str) for w in words):
            raise TypeError("words must be a list of word lists, e.g. [['EU', 'rejects', 'German', 'call']]")
        body: dict[str, Any] = {"words": [list(w) for w in words], "layers": layers, "site": site,
                                "combine": combine, "level": "word", "truncate": truncate, "output_dtype": output_dtype,
                                "encoding": "base64"}
        body.update({k: v for k, v in {"weights": weights, "subword": subword}.items() if v is not None})
        out = self._call("POST", "/v1/encode", body)
        return [_unpack(v) for v in out["vectors"]]
