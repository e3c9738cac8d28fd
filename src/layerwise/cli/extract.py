"""``layerwise extract INPUT -o STORE``: corpus-scale, resumable extraction into a feature store."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import typer

from ..encoding.precision import apply_calibration
from ..errors import LayerwiseError
from ..model.options import ModelOptions

if TYPE_CHECKING:
    from ..extractor import Extractor
from .options import (
    AddEosOpt,
    CalibrationOpt,
    CombineOpt,
    DimensionsOpt,
    LayersOpt,
    NoHeaderOpt,
    OutputDtypeOpt,
    PromptOpt,
    SiteOpt,
    WeightsOpt,
    err_console,
    extractor,
    model_flags,
    parse_layers,
    parse_weights,
    user_errors,
)


def parse_workers(value: str) -> int | str:
    """``--num-workers``: ``auto`` or a number (a word is refused, naming the valid values)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise LayerwiseError(f"--num-workers {value!r} is not a number; give a positive int, or auto (the pool "
                             f"sized from the cluster)") from None


def ray_line(done: Any, output: str) -> str:
    """The summary line of ``extract --engine ray`` (a :class:`~layerwise.extraction.ray.RaySummary`)."""
    pool = f", {done.workers} encode worker{'' if done.workers == 1 else 's'}" if done.workers else ""
    return (f"ray: {done.parts} parts ({done.already_complete} already complete{pool}), {done.records:,} records, "
            f"{done.skipped:,} skipped in {done.seconds:.1f}s -> {output}")


def interrupted(output: str) -> str:
    """The line an interrupted (Ctrl-C) extract says: how many records its finished shards hold, and that the same
    command resumes after them."""
    from ..store.manifest import read_manifest

    try:
        shards = read_manifest(output)["shards"]
    except (LayerwiseError, OSError, KeyError, TypeError):
        return f"interrupted: nothing of {output} was finished; rerun the same command to start it again"
    records = sum(int(e.get("records", 0)) for e in shards)
    return (f"interrupted: {records:,} records in {len(shards):,} finished shard{'s' if len(shards) != 1 else ''} of "
            f"{output} are safe; rerun the same command to resume after them")


@model_flags
def extract(
    input: str = typer.Argument(
        ..., help="Corpus: .txt, .jsonl, .csv, .tsv, .parquet, CoNLL-2003, .conllu, or - (stdin)."
    ),
    output: str = typer.Option(..., "--output", "-o", help="Store directory (created; resumed if it holds this run)."),
    layers: str = LayersOpt,
    site: str = SiteOpt,
    combine: str = CombineOpt,
    weights: Optional[str] = WeightsOpt,
    pool: Optional[str] = typer.Option(
        None, "--pool", "-p", help="Sentence level: cls, pooler, mean (default), max, mean_max, last."
    ),
    level: str = typer.Option("sentence", "--level", help="sentence (one vector a record), token or word (ragged)."),
    subword: Optional[str] = typer.Option(
        None, "--subword", help="Word level: first (default), last, mean, max or first_last."
    ),
    skip_special: bool = typer.Option(False, "--skip-special", help="Leave special tokens out of the sentence pool."),
    truncate: bool = typer.Option(
        False, "--truncate", help="Cut long texts at the model maximum instead of windowing."
    ),
    output_dtype: str = OutputDtypeOpt,
    dimensions: Optional[int] = DimensionsOpt,
    calibration: Optional[Path] = CalibrationOpt,
    fmt: Optional[str] = typer.Option(
        None,
        "--format",
        "-f",
        help="Input format if the suffix does not tell: txt, jsonl, csv, tsv, parquet, conll, conllu.",
    ),
    text_field: Optional[str] = typer.Option(
        None, "--text-field", "--text-column", help="Column/field with the text: a name, or a CSV/TSV column's "
        "position from 1 (default: text, else sentence)."
    ),
    no_header: bool = NoHeaderOpt,
    keep: List[str] = typer.Option(
        [], "--keep", help="Column to carry into the store (repeat or comma-separate), e.g. --keep id,label."
    ),
    batch_tokens: Optional[int] = typer.Option(
        None, "--batch-tokens", help="Token budget per forward batch (default 1024 on CPU, 16384 on CUDA)."
    ),
    max_records: Optional[int] = typer.Option(None, "--max-records", help="Stop after this many records in the store."),
    num_shards: int = typer.Option(
        1, "--num-shards", help="Split the input into N parts (record number modulo N); run one command per part."
    ),
    shard_index: int = typer.Option(
        0, "--shard-index", help="Which part this run extracts (0..N-1); join the parts with layerwise merge."
    ),
    engine: str = typer.Option("local", "--engine", help="local (this process) or ray (Ray cluster; layerwise[ray])."),
    num_workers: str = typer.Option(
        "auto", "--num-workers",
        help="--engine ray: encode actors, each loading the model once; auto sizes the pool from the cluster.",
    ),
    gpus_per_worker: float = typer.Option(0, "--gpus-per-worker", help="--engine ray: GPUs per actor."),
    cpus_per_worker: int = typer.Option(1, "--cpus-per-worker", help="--engine ray: CPUs (torch threads) per actor."),
    part_records: int = typer.Option(10_000, "--part-records",
                                     help="--engine ray: records per part, the unit of work and resume (keep it)."),
    address: Optional[str] = typer.Option(None, "--address", help="--engine ray: a running cluster (ray.init)."),
    stall_timeout: float = typer.Option(
        600, "--stall-timeout", help="--engine ray: end the run when no part finished for this many seconds."
    ),
    shard_records: Optional[int] = typer.Option(
        None, "--shard-records", help="Records per shard (default: ~32 MB of features)."
    ),
    strict: bool = typer.Option(
        False, "--strict", help="Stop at the first bad record instead of logging and skipping it."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a store made with other options."),
    resume_check: str = typer.Option(
        "sha256", "--resume-check",
        help="What a resume checks of every finished shard: sha256 (every byte, ~1 s/GB) or headers (sizes and "
             "headers, and the last shard's sha256).",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q",
                               help="No progress bar, no summary line and no one-time work lines (exports)."),
    prompt: str = PromptOpt,
    add_eos: bool = AddEosOpt,
    context_size: Optional[int] = typer.Option(
        None, "--context-size", min=2,
        help="--level token: token activations for sparse-autoencoder trainers: the corpus packed into contexts of N "
             "tokens (a BOS token first where the model has one), each --layers layer its own array, --output-dtype "
             "float32, float16, bfloat16 or float8 (e4m3, a scale per token), read back by "
             "FeatureStore.token_loader.",
    ),
    max_contexts: Optional[int] = typer.Option(None, "--max-contexts", min=1,
                                               help="--context-size: stop after this many contexts in the store."),
    *,
    model_options: ModelOptions,
) -> None:
    """Extract features for every record of INPUT into the store OUTPUT; rerun the same command to resume."""
    from ..corpus.readers import ReadOptions, detect_format
    from ..encoding.spec import EncodeSpec
    from ..extraction.engine import ExtractOptions
    from ..extraction.engine import extract as run_extract
    from ..notices import set_quiet

    set_quiet(quiet)  # the one-time work's lines (exports, the runtime that takes over) too
    if context_size is not None:
        if level != "token":
            with user_errors():
                raise LayerwiseError(f"--context-size gives token activations in fixed-length contexts: add --level "
                                     f"token (not --level {level})")
        given = {"--combine": combine != "concat", "--weights": weights is not None,
                 "--pool": pool is not None, "--subword": subword is not None, "--truncate": truncate,
                 "--dimensions": dimensions is not None, "--calibration": calibration is not None,
                 "--keep": bool(keep), "--num-shards": num_shards != 1,
                 "--shard-records": shard_records is not None, "--max-records": max_records is not None,
                 "--prompt": bool(prompt), "--add-eos": add_eos,
                 "--skip-special (the loader leaves special tokens out: token_loader(skip_special=))": skip_special}
        with user_errors():
            activations(input, output, layers, site, context_size, output_dtype, fmt=fmt, text_field=text_field,
                        header=not no_header, batch_tokens=batch_tokens, engine=engine,
                        workers=parse_workers(num_workers), cpus_per_worker=cpus_per_worker,
                        gpus_per_worker=gpus_per_worker, address=address,
                        max_contexts=max_contexts, strict=strict, overwrite=overwrite, quiet=quiet,
                        model_options=model_options, refused=[k for k, v in given.items() if v])
        return
    with user_errors():
        kept = tuple(k.strip() for item in keep for k in item.split(",") if k.strip())
        spec = EncodeSpec(
            layers=parse_layers(layers), site=site, combine=combine, weights=parse_weights(weights), level=level,
            pool=pool, subword=subword, skip_special_tokens=skip_special, truncate=truncate, output_dtype=output_dtype,
            prompt=prompt, add_eos=add_eos, dimensions=dimensions,
        )
        loaded: list[Extractor] = []  # the model, loaded once: for calibration texts and for the local engine

        def model() -> Extractor:
            if not loaded:
                loaded.append(extractor(model_options))
            return loaded[0]

        spec = apply_calibration(spec, calibration, lambda texts, s: model().calibrate(texts, s))
        reading = ReadOptions(format=fmt, text_field=text_field, keep=kept, header=not no_header)
        detect_format(input, fmt)  # a directory or an unknown suffix is named before the model loads
        options = ExtractOptions(batch_tokens=batch_tokens, max_records=max_records, shard_records=shard_records,
                                 strict=strict, overwrite=overwrite, progress=False if quiet else None,
                                 num_shards=num_shards, shard_index=shard_index, resume_check=resume_check)
        if engine not in ("local", "ray"):
            raise LayerwiseError(f"unknown --engine {engine!r}. Valid engines are: local, ray")
        if engine == "ray":
            from ..extraction.ray import extract as on_ray

            done = on_ray(input, output, spec, model=model_options, reading=reading, options=options,
                          num_workers=parse_workers(num_workers), cpus_per_worker=cpus_per_worker,
                          gpus_per_worker=gpus_per_worker, part_records=part_records, address=address,
                          stall_timeout=stall_timeout)
            if not quiet:
                err_console.print(ray_line(done, output), highlight=False, soft_wrap=True)
            return
        ex = model()
        try:
            summary = run_extract(input, output, spec, model=ex, reading=reading, options=options)
        except KeyboardInterrupt:
            err_console.print(interrupted(output), highlight=False, soft_wrap=True)
            raise typer.Exit(130) from None
    report(summary, ex, output, quiet)


def activations(input: str, output: str, layers: str, site: str, context_size: int, dtype: str, *, fmt: str | None,
                text_field: str | None, header: bool, batch_tokens: int | None, engine: str, workers: int | str,
                cpus_per_worker: int, gpus_per_worker: float, address: str | None,
                max_contexts: int | None, strict: bool, overwrite: bool, quiet: bool, model_options: ModelOptions,
                refused: list[str]) -> None:
    """``extract --level token --context-size N``: a token-activation store
    (:func:`~layerwise.extraction.activations.extract_activations`); the options of pooled or per-record features are
    refused, named."""
    from ..corpus.readers import ReadOptions, detect_format
    from ..encoding.contexts import check_dtype
    from ..extraction.activations import extract_activations

    if refused:
        raise LayerwiseError(f"--context-size writes token activations in fixed-length contexts (--level token, each "
                             f"layer its own array): {', '.join(refused)} do{'es' if len(refused) == 1 else ''} not "
                             f"apply; leave {'it' if len(refused) == 1 else 'them'} out")
    check_dtype(dtype)
    if workers == "auto":
        workers = 2  # the compute stage's actors (reading, packing and writing stay in this process)
    reading = ReadOptions(format=fmt, text_field=text_field, header=header)
    detect_format(input, fmt)
    ex = extractor(model_options)
    try:
        summary = extract_activations(input, output, parse_layers(layers), site=site, context_size=context_size,
                                      dtype=dtype, model=ex, reading=reading, batch_tokens=batch_tokens,
                                      max_contexts=max_contexts, overwrite=overwrite, strict=strict,
                                      progress=False if quiet else None, engine=engine, num_workers=int(workers),
                                      cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker,
                                      address=address)
    except KeyboardInterrupt:
        err_console.print(f"interrupted: the finished shards of {output} are safe; rerun the same command to resume "
                          f"after them", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    for line in summary.repairs:
        err_console.print(f"repaired: {line}", highlight=False, soft_wrap=True)
    if not quiet:
        err_console.print(summary.line(), highlight=False, soft_wrap=True)


def report(summary: Any, ex: Extractor, output: str, quiet: bool) -> None:
    """What a local run says when it ends: what its resume repaired (even with ``--quiet``), the model, the summary
    line, and where the skipped records are listed."""
    for repair in summary.repairs:  # said even with --quiet: the store was damaged
        err_console.print(f"[yellow]repaired:[/yellow] {repair}", highlight=False, soft_wrap=True)
    if not quiet:
        lm = ex.loaded
        err_console.print(f"{lm.name}: device {lm.device}, dtype {ex.backend.precision}, "
                          f"backend {ex.backend.name}", highlight=False, soft_wrap=True)
        err_console.print(summary.line(), highlight=False, soft_wrap=True)
    if summary.skipped and not quiet:
        what = "1 skipped record is" if summary.skipped == 1 else f"{summary.skipped:,} skipped records are"
        err_console.print(f"{what} listed in {output}/errors.jsonl", highlight=False, soft_wrap=True)
    sys.stderr.flush()
