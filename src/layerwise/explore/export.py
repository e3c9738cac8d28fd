"""One explorer as a single self-contained HTML file: ``layerwise explore STORE --export page.html``.

The page is the live explorer's (``static/index.html`` with its CSS and JavaScript inlined) plus the answers its API
would give, computed now and embedded as JSON: ``info``, every layer view for every projection method, the
per-layer scores, and every probe directory named with ``--probe``. The page's ``api()`` reads them instead of
asking a server, so the file opens from disk, offline, and makes no request at all. The sentence view needs the
model, so the exported page says to run ``layerwise explore`` for it.

The JSON is embedded with ``<``, ``>`` and ``&`` written as ``\\u003c``, ``\\u003e`` and ``\\u0026``: a text holding
``</script>`` stays a string and cannot end the script element.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from ..errors import LayerwiseError
from ..outputs import OwnedOutput
from .app import Explorer
from .projection import available_methods

# told of each step of a snapshot before it runs: (steps done, steps in all, what the next step computes)
Progress = Callable[[int, int, str], None]

SNAPSHOT = "LAYERWISE_SNAPSHOT"  # the global the page's api() reads


def snapshot(explorer: Explorer, progress: Progress | None = None) -> dict[str, Any]:
    """Every answer the page can ask for without a model: ``{"info", "layers": {"layer/K?method=M": view},
    "scores", "probes": {"I": probe}}``.

    ``progress`` is told of each step before it runs (a layer view per projection method, the scores, each probe
    directory; a UMAP view of a few hundred records takes seconds) and once more when all are done."""
    info = explorer.info()
    info["exported"] = True  # the page shows what it can from the embedded answers
    out: dict[str, Any] = {"info": info, "layers": {}, "scores": None, "probes": {}}
    corpus = explorer.corpus
    steps: list[tuple[str, dict[str, Any], str, Callable[[], Any]]] = []  # (what, into, key, compute)
    if corpus is not None:
        for method in available_methods():
            for k, name in enumerate(corpus.layer_names):
                steps.append((f"{name} ({method})", out["layers"], f"layer/{k}?method={method}",
                              functools.partial(explorer.layer, k, method)))
        if corpus.labels is not None:
            steps.append(("scores", out, "scores", explorer.scores))
    for i in range(len(explorer.probe_dirs)):
        steps.append((f"probe {i + 1}", out["probes"], str(i), functools.partial(explorer.probe, i)))
    for done, (what, into, key, compute) in enumerate(steps):
        if progress is not None:
            progress(done, len(steps), what)
        into[key] = compute()
    if progress is not None:
        progress(len(steps), len(steps), "done")
    return out


def _script_json(data: Any) -> str:
    """``data`` as JSON that is safe inside a ``<script>`` element."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def export_page(explorer: Explorer, path: str | os.PathLike, *, overwrite: bool = False,
                progress: Progress | None = None) -> Path:
    """Write ``explorer`` as one offline HTML file at ``path`` (see the module docstring); returns the path.
    ``progress`` is told of each step of the snapshot (see :func:`snapshot`).

    The page carries its marker (the ``window.LAYERWISE_SNAPSHOT`` its data is in): an earlier exported page is
    replaced only with ``overwrite``, any other file never (:class:`~layerwise.outputs.OwnedOutput`).

    Raises:
        LayerwiseError: ``path`` is a directory, a file that is not an exported page, or an earlier page without
            ``overwrite``; nothing to show.
    """
    output = owned_page(Path(path))
    output.check(overwrite)
    if explorer.corpus is None and not explorer.probe_dirs:
        raise LayerwiseError("nothing to export: give a STORE, --texts FILE or --probe DIR")
    static = resources.files("layerwise.explore").joinpath("static")
    page = static.joinpath("index.html").read_text(encoding="utf-8")
    css = static.joinpath("explorer.css").read_text(encoding="utf-8")
    js = static.joinpath("explorer.js").read_text(encoding="utf-8")
    link = '<link rel="stylesheet" href="/explorer/static/explorer.css">'
    script = '<script src="/explorer/static/explorer.js"></script>'
    if link not in page or script not in page:
        raise LayerwiseError("the explorer page does not reference its CSS and script as expected; reinstall layerwise")
    data = f"<script>window.{SNAPSHOT} = {_script_json(snapshot(explorer, progress))};</script>"
    page = page.replace(link, f"<style>\n{css}\n</style>").replace(script, f"{data}\n<script>\n{js}\n</script>")
    return output.write(lambda staged: staged.write_text(page, encoding="utf-8"), overwrite=overwrite)


def _is_page(path: Path) -> bool:
    """Whether ``path`` is a page this module exported (its data script names :data:`SNAPSHOT`)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return any(f"<script>window.{SNAPSHOT} = " in line for line in fh)
    except OSError:
        return False


def owned_page(path: Path) -> OwnedOutput:
    """An exported page at ``path`` as an :class:`~layerwise.outputs.OwnedOutput` (its marker: the data script)."""
    return OwnedOutput(path, "file", "layerwise explorer page", owned=_is_page,
                       marker=f"window.{SNAPSHOT} data script of an exported explorer page")


__all__ = ["SNAPSHOT", "Progress", "export_page", "owned_page", "snapshot"]
