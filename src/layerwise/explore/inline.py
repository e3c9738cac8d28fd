"""The explorer inside a notebook: ``lw.explore(store_or_texts)`` shows it in the output cell.

It starts the explorer's app on a free port of 127.0.0.1 in a background thread (uvicorn), and returns an
:class:`InlineExplorer` whose ``_repr_html_`` is an ``<iframe>`` on that page, so the cell shows the live explorer
(corpus, sentence and probe views; nothing fetched from the network). ``.stop()`` stops the server (and so does the
end of the Python process); ``with lw.explore(...) as shown:`` stops it on leaving the block.
"""

from __future__ import annotations

import atexit
import html
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from ..errors import LayerwiseError
from .app import Explorer, create_explorer_app


class InlineExplorer:
    """A running explorer on ``url`` (``http://127.0.0.1:PORT/``), shown as an iframe in a notebook."""

    def __init__(self, explorer: Explorer, port: int, height: int):
        import uvicorn

        self.explorer, self.port, self.height = explorer, port, height
        self.url = f"http://127.0.0.1:{port}/"
        config = uvicorn.Config(create_explorer_app(explorer), host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name=f"layerwise-explore-{port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise LayerwiseError(f"the explorer could not start on 127.0.0.1:{port}; give another port=")
            time.sleep(0.05)
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        """Whether the server still answers."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the server (the iframe goes blank); safe to call twice."""
        self._server.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def __enter__(self) -> "InlineExplorer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _repr_html_(self) -> str:
        src = html.escape(self.url, quote=True)
        return (f'<iframe src="{src}" width="100%" height="{int(self.height)}" style="border:1px solid #ddd" '
                f'title="layerwise explorer"></iframe>')

    def __repr__(self) -> str:
        return f"InlineExplorer({self.url!r}, running={self.running})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def show(data: Any = None, *, labels: str | Sequence[object] | None = None, model: Any = None,
         probe: Sequence[str | os.PathLike] = (), sample: int = 2000, port: int | None = None,
         height: int = 720) -> InlineExplorer:
    """Start the explorer on ``data`` and return it for display in a notebook cell.

    Args:
        data: a sentence-level store (its directory, or an opened ``FeatureStore``), or a list of texts (encoded
            now: every layer, mean-pooled), or ``None`` for only the sentence and probe views.
        labels: a store column kept with ``--keep`` to colour by, or one label per text.
        model: the :class:`~layerwise.Extractor` (or its ``ModelOptions`` / path) for the sentence view and for
            texts; default: the store's model, else the embedded default.
        probe: ``layerwise probe`` output directories for the probe view.
        sample: show at most this many records (a seeded sample).
        port: the local port (default: a free one). height: the iframe's height in pixels.

    Returns:
        An :class:`InlineExplorer` (displays as an iframe; ``.stop()`` ends it).
    """
    from ..extractor import Extractor
    from .corpus import corpus_from_store, corpus_from_texts
    from .probe_dir import read_probe_dir

    for folder in probe:
        read_probe_dir(folder)
    corpus = None
    if data is not None and (isinstance(data, (str, os.PathLike)) or type(data).__name__ == "FeatureStore"):
        path = data if isinstance(data, (str, os.PathLike)) else data.path
        if not isinstance(labels, (str, type(None))):
            raise LayerwiseError("with a store, labels= names a column kept with --keep (e.g. labels='label')")
        corpus = corpus_from_store(Path(path), labels=labels, sample=sample)
        if model is None:
            model = corpus.model
    ex = model if isinstance(model, Extractor) else Extractor.of(model)
    if data is not None and corpus is None:
        if isinstance(data, str) or not isinstance(data, Sequence):
            raise LayerwiseError(f"lw.explore takes a store directory, a FeatureStore or a list of texts; got "
                                 f"{type(data).__name__}")
        if isinstance(labels, str):
            raise LayerwiseError("with texts, labels= is one label per text (a list), not a column name")
        corpus = corpus_from_texts(ex, list(data), labels=labels, sample=sample)
    explorer = Explorer(corpus=corpus, extractor=ex, probe_dirs=[os.fspath(p) for p in probe])
    return InlineExplorer(explorer, port or _free_port(), height)


__all__ = ["InlineExplorer", "show"]
