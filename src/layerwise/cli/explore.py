"""``layerwise explore``: the layer explorer, a local web page (corpus, sentence and probe views)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import typer
from rich.markup import escape

from ..errors import LayerwiseError
from ..model.options import ModelOptions
from .options import err_console, extractor, model_flags, user_errors

if TYPE_CHECKING:
    from ..explore.export import Progress

SampleOpt = typer.Option(2000, "--sample", help="Show at most this many records (a seeded random sample).")
LabelsOpt = typer.Option(None, "--labels", help="Column holding the labels to colour by (kept with --keep in a store).")
ProbeDirOpt = typer.Option(None, "--probe", help="A layerwise probe output directory to open (repeatable).")


@contextlib.contextmanager
def export_progress(quiet: bool) -> Iterator[Progress | None]:
    """The progress of ``--export`` on stderr: a rich bar on a terminal (gone when done), else one line when the
    work starts; nothing with ``-q``."""
    if quiet:
        yield None
        return
    if not err_console.is_terminal:
        started: list[bool] = []

        def line(done: int, total: int, what: str) -> None:
            if not started and total:
                started.append(True)
                err_console.print(f"explore: computing {total} parts of the page (each layer's projections, the "
                                  f"scores, the probes)...", highlight=False, soft_wrap=True)

        yield line
        return
    from rich import progress as rich_progress

    columns = (rich_progress.TextColumn("export"), rich_progress.BarColumn(), rich_progress.MofNCompleteColumn(),
               rich_progress.TextColumn("{task.description}"), rich_progress.TimeElapsedColumn())
    with rich_progress.Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("", total=None)

        def update(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=escape(what))

        yield update


@model_flags
def explore(
    store: Optional[str] = typer.Argument(None, help="A sentence-level store (made with --combine stack "
                                                     "--layers all to see every layer)."),
    texts: Optional[str] = typer.Option(None, "--texts", help="Or a text file (txt, TSV/CSV, JSONL, parquet) to "
                                                             "encode now, every layer mean-pooled."),
    labels: Optional[str] = LabelsOpt,
    text_field: Optional[str] = typer.Option(None, "--text-field", help="Column holding the text (default text, "
                                                                       "else sentence)."),
    probe: Optional[list[str]] = ProbeDirOpt,
    sample: int = SampleOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (default loopback only)."),
    port: int = typer.Option(8765, "--port", help="TCP port, 1..65535."),
    export: Optional[str] = typer.Option(
        None, "--export", help="Write one self-contained HTML file (data included, opens offline) instead of serving."
    ),
    overwrite: bool = typer.Option(False, "--overwrite",
                                   help="With --export: replace a page layerwise exported earlier (never any other "
                                        "file)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress and no one-time work lines on stderr."),
    *,
    model_options: ModelOptions,
) -> None:
    """Open the layer explorer at http://127.0.0.1:8765 (works offline: nothing is fetched from the network).

    The model (for the sentence view and --texts) is --model, else the store's model, else the embedded
    all-MiniLM-L6-v2."""
    import uvicorn

    from ..explore import Explorer, corpus_from_store, create_explorer_app
    from ..explore.corpus import corpus_from_file
    from ..explore.probe_dir import read_probe_dir
    from ..notices import set_quiet

    set_quiet(quiet)
    with user_errors():
        if not 1 <= port <= 65535:
            raise LayerwiseError(f"--port {port} is not a TCP port; give one in 1..65535 (e.g. --port 8765)")
        if store and texts:
            raise LayerwiseError("give a STORE or --texts FILE, not both")
        for folder in probe or []:
            read_probe_dir(folder)  # a wrong directory is said now, not in the browser
        corpus = corpus_from_store(store, labels=labels, sample=sample) if store else None
        if model_options.model is None and corpus is not None:
            model_options = model_options.replace(model=corpus.model)
        ex = extractor(model_options)
        if texts:
            working = err_console.status(f"encoding {escape(texts)}, every layer") if not quiet else None
            with working or contextlib.nullcontext():  # a spinner on a terminal; rich prints nothing elsewhere
                corpus = corpus_from_file(ex, texts, labels=labels, text_field=text_field, sample=sample)
    explorer = Explorer(corpus=corpus, extractor=ex, probe_dirs=list(probe or []))
    if export:
        from ..explore.export import export_page

        with user_errors(), export_progress(quiet) as progress:
            written = export_page(explorer, export, overwrite=overwrite, progress=progress)
        err_console.print(f"exported the explorer ({corpus.note if corpus is not None else 'no corpus'}) to "
                          f"{written}: open it in a browser, offline", highlight=False)
        return
    app = create_explorer_app(explorer)
    what = corpus.note if corpus is not None else "no corpus"
    err_console.print(f"layerwise explorer on http://{host}:{port} ({what}; model {ex.loaded.name})", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level="warning")
