"""Token activations for sparse-autoencoder trainers: a corpus packed into fixed-length contexts, several layers in one
pass, each layer written as its own array of a token-activation store (:mod:`layerwise.store.activations`).

Three stages run at once, each in its own thread, with bounded queues between them (memory is bounded whatever the
corpus's size: a few batches of token ids, and two shard buffers):

1. **read and pack** (a thread): the records are read and tokenised (no special tokens) 256 at a time and packed into
   contexts (:class:`~layerwise.encoding.contexts.ContextPacker`), ``batch`` contexts a batch;
2. **compute** (the caller's thread): every batch through the store's runtime (pinned for the whole store:
   :mod:`layerwise.extraction.runtime`) to the deepest layer asked, ``plan.ahead`` batches in flight; each layer's
   ``[batch * N, W]`` states converted where they were computed (float16, bfloat16, or float8 e4m3 with a float32
   scale per token, ``amax / 448``) and copied into the shard buffer being filled (pinned host memory on a GPU,
   copied without blocking the compute);
3. **write** (a thread): a full shard buffer written as one shard (sha256 while writing) and listed in the manifest,
   while the compute fills the other buffer.

A model larger than memory runs block by block (``ModelOptions.max_memory``): its backend groups the batches into
chunks and reads each block once per chunk. float8's cosine against float32 is measured on every token and recorded
per layer in the manifest (``fidelity``).

Example::

    >>> summary = extract_activations("corpus.txt", "acts", layers=[4, 8, 12], context_size=128,
    ...                               dtype="bfloat16", model="gpt2")                 # doctest: +SKIP
    >>> summary.line()                                                                  # doctest: +SKIP
    '1,563 contexts, 200,064 tokens in 41.0s (4,880 tokens/s), 1,845.2 MB in 8 shards -> acts'
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..corpus.readers import BadRecord, ReadOptions
from ..corpus.sources import open_source
from ..encoding.contexts import ContextPacker, ContextSpec, special_ids
from ..encoding.spec import EncodeSpec
from ..errors import ExtractError
from ..extractor import Extractor, check_budget
from ..model.describe import model_identity
from ..model.options import ModelOptions
from ..notices import notice
from ..progress import progress_bar
from ..store.activations import ActivationWriter, is_activation_store
from ..store.layout import MANIFEST, read_json
from .activation_compute import TORCH_DTYPES, Converted, LocalCompute, RayCompute
from .runtime import pinned, recorded_runtime, store_runtime

SHARD_BYTES = 256 << 20  # target shard size on disk; two shard buffers are the run's memory for states
TOKENIZE_CHUNK = 256  # records tokenised at a time
_END = object()
ENGINES = ("local", "ray")


@dataclass
class ActivationSummary:
    """What one run did: ``contexts``/``tokens`` of this run, ``total_contexts`` of the whole store."""

    store: str
    contexts: int = 0
    tokens: int = 0
    skipped: int = 0
    seconds: float = 0.0
    bytes_written: int = 0
    shards_written: int = 0
    total_contexts: int = 0
    resumed_from: int = 0
    left_over: int = 0
    status: str = "complete"  # complete | partial (max_contexts) | already_complete
    runtime: str = ""
    fidelity: dict[str, Any] = field(default_factory=dict)
    repairs: list[str] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the command prints."""
        if self.status == "already_complete":
            return f"{self.store}: already complete ({self.total_contexts:,} contexts); nothing to do"
        resumed = f", resumed after {self.resumed_from:,} contexts" if self.resumed_from else ""
        return (f"{self.contexts:,} contexts, {self.tokens:,} tokens in {self.seconds:.1f}s "
                f"({self.tokens_per_second:,.0f} tokens/s), {self.bytes_written / 1e6:,.1f} MB in "
                f"{self.shards_written:,} shard{'' if self.shards_written == 1 else 's'}, "
                f"{self.skipped:,} records skipped, {self.left_over:,} tokens left over at the end{resumed} -> "
                f"{self.store}")


@dataclass
class _Batch:
    ids: np.ndarray  # [b, N] int32
    first_line: int
    last_line: int


class _Shard:
    """One shard buffer: token ids and each layer's values (and float8 scales), filled batch by batch."""

    def __init__(self, contexts: int, size: int, layers: tuple[int, ...], width: int, dtype: str, pin: bool):
        rows = contexts * size
        self.capacity, self.size = contexts, size
        self.ids = np.empty((contexts, size), np.int32)
        self.values = {k: torch.empty((rows, width), dtype=TORCH_DTYPES[dtype], pin_memory=pin) for k in layers}
        self.scales = ({k: torch.empty(rows, dtype=torch.float32, pin_memory=pin) for k in layers}
                       if dtype == "float8" else {})
        self.filled = 0
        self.first_line = self.last_line = 0
        self.consumed = 0  # stream tokens packed up to this shard's last context
        self.done = threading.Event()
        self.done.set()

    def bits(self, k: int) -> np.ndarray:
        """Layer ``k``'s filled values as the numpy bits a shard stores."""
        t = self.values[k][: self.filled * self.size]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(np.uint16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy()
        return t.numpy()


class _Fidelity:
    """float8's cosine against float32, per layer: sum, minimum and count over every token."""

    def __init__(self) -> None:
        self.sums: dict[int, float] = {}
        self.mins: dict[int, float] = {}
        self.counts: dict[int, int] = {}

    def add(self, k: int, cos: torch.Tensor) -> None:
        self.sums[k] = self.sums.get(k, 0.0) + float(cos.double().sum())
        self.mins[k] = min(self.mins.get(k, 1.0), float(cos.min()))
        self.counts[k] = self.counts.get(k, 0) + int(cos.numel())

    def report(self, old: dict[str, Any]) -> dict[str, Any]:
        """Per layer ``{"cosine_mean", "cosine_min", "tokens"}``, merged with what a resumed run recorded."""
        out = dict(old)
        for k, n in self.counts.items():
            prev = old.get(str(k), {"cosine_mean": 0.0, "cosine_min": 1.0, "tokens": 0})
            total = prev["tokens"] + n
            out[str(k)] = {"cosine_mean": (prev["cosine_mean"] * prev["tokens"] + self.sums[k]) / total,
                           "cosine_min": min(prev["cosine_min"], self.mins[k]), "tokens": total}
        return out


def _place(converted: list[Converted], layers: tuple[int, ...], shard: _Shard, at: int, fidelity: _Fidelity) -> None:
    """A batch's converted layers into rows ``at ..`` of ``shard`` (pinned host memory on a GPU: without blocking)."""
    for k, c in zip(layers, converted):
        rows = c.values.shape[0]
        shard.values[k][at : at + rows].copy_(c.values, non_blocking=True)
        if c.scale is not None:
            shard.scales[k][at : at + rows].copy_(c.scale, non_blocking=True)
        if c.cosine is not None:
            fidelity.add(k, c.cosine)


def _producer(source: Any, reading: ReadOptions, tokenizer: Any, packer: ContextPacker, batch: int,
              out: "queue.Queue[Any]", stop: threading.Event, errors: list[BadRecord], limit: int | None) -> None:
    """Stage 1 (see the module docstring): batches of contexts into ``out``, then ``_END`` (or the exception)."""
    try:
        pending: list[tuple[np.ndarray, int]] = []
        given = 0

        def flush(final: bool) -> Iterator[_Batch]:
            nonlocal pending, given
            while len(pending) >= batch or (final and pending):
                take = pending[:batch]
                pending = pending[batch:]
                given += len(take)
                yield _Batch(np.stack([c for c, _ in take]), take[0][1], take[-1][1])

        def chunks() -> Iterator[list[Any]]:
            chunk: list[Any] = []
            for item in source.records(reading):
                if isinstance(item, BadRecord):
                    errors.append(item)
                    continue
                chunk.append(item)
                if len(chunk) >= TOKENIZE_CHUNK:
                    yield chunk
                    chunk = []
            if chunk:
                yield chunk

        for chunk in chunks():
            ids = tokenizer([r.text for r in chunk], add_special_tokens=False, return_attention_mask=False,
                            verbose=False)["input_ids"]
            for record, record_ids in zip(chunk, ids):
                pending.extend(packer.feed(record_ids, record.line))
            if limit is not None and given + len(pending) >= limit:
                pending = pending[: limit - given]
                break
            for b in flush(False):
                if stop.is_set():
                    return
                out.put(b)
        for b in flush(True):
            if stop.is_set():
                return
            out.put(b)
        out.put(_END)
    except BaseException as exc:  # handed to the caller's thread, which raises it
        out.put(exc)


def _check_layers(ex: Extractor, layers: Any, site: str) -> tuple[int, ...]:
    spec = EncodeSpec(layers=layers, site=site, level="token", combine="stack").resolve(ex)
    return tuple(spec.layer_indices)


def extract_activations(
    data: Any,
    output: str,
    layers: Any = -1,
    *,
    site: str = "block",
    context_size: int = 128,
    dtype: str = "float32",
    model: Extractor | ModelOptions | str | None = None,
    reading: ReadOptions | None = None,
    bos: bool = True,
    skip_special: bool = True,
    batch_tokens: int | None = None,
    shard_bytes: int = SHARD_BYTES,
    max_contexts: int | None = None,
    overwrite: bool = False,
    strict: bool = False,
    progress: bool | None = None,
    engine: str = "local",
    num_workers: int = 2,
    cpus_per_worker: int = 1,
    gpus_per_worker: float = 0,
    address: str | None = None,
) -> ActivationSummary:
    """Token activations of ``layers`` at ``site`` for a corpus, packed into contexts of ``context_size`` tokens,
    into the token-activation store ``output`` (see the module docstring). A rerun of the same call resumes.

    Args:
        data: the corpus (a file, a directory, ``"-"``, a ``datasets.Dataset``; any format :class:`ReadOptions`
            reads).
        output: the store directory.
        layers: a layer spec (``[4, 8, 12]``, ``"-4:"``, ``"all"``; 0 = embeddings).
        site: ``block`` (the residual stream), ``attention``, ``intermediate``, ``pre_ln`` or ``raw``.
        context_size: tokens per context (at most the model's window).
        dtype: ``float32 | float16 | bfloat16 | float8``.
        model: the model (an :class:`~layerwise.Extractor`, :class:`~layerwise.ModelOptions` or a name; default the
            embedded model).
        bos: the model's beginning-of-sequence token first in every context.
        skip_special: the readers' default for leaving special tokens' rows out.
        batch_tokens: tokens per forward batch (default the Extractor's; at least one context).
        shard_bytes: bytes per shard on disk (two shard buffers are held in memory).
        max_contexts: stop after this many contexts in the store (status ``partial``).
        overwrite: replace a token-activation store made with other options.
        strict: stop at the first record that cannot be read (else it is logged in ``errors.jsonl`` and skipped).
        progress: a progress bar (``None``: on a terminal; a plain line every 30 s elsewhere).
        engine: ``local`` (this process) or ``ray``: the compute stage on ``num_workers`` Ray actors (each loading
            the model, with ``cpus_per_worker`` threads and ``gpus_per_worker`` GPUs) of the cluster at ``address``
            (else one started for the run); reading, packing and writing stay here, so the store is the same.

    Returns:
        :class:`ActivationSummary`.

    Raises:
        ExtractError: a context longer than the model's window, a bad record under ``strict``, a resume on another
            runtime. SpecError: a bad layer, site, dtype or context size. StoreError: the output is not a store this
            run may write.
    """
    started = time.perf_counter()
    if engine not in ENGINES:
        raise ExtractError(f"unknown engine {engine!r}. Valid engines are: {', '.join(ENGINES)}")
    ex = Extractor.of(model)
    layer_ids = _check_layers(ex, layers, site)
    spec = ContextSpec(layers=layer_ids, site=site, context_size=context_size, dtype=dtype, bos=bos,
                       skip_special=skip_special)
    window = ex.max_length
    if window is not None and context_size > window:
        raise ExtractError(f"context_size {context_size} is longer than {ex.loaded.name}'s window of {window} tokens: "
                           f"give --context-size {window} or less")
    reading = reading or ReadOptions()
    source = open_source(data, reading)
    tok = ex.tokenizer
    bos_id, separator_id, specials = special_ids(tok)
    bos_id = bos_id if bos else None
    width = ex.site_width(site)
    header = {
        "spec": spec.to_dict(),
        "model": model_identity(ex.describe(), ex.fingerprint()),
        "model_options": ex.options.to_dict(),
        "tokenizer": {"class": type(tok).__name__, "vocab_size": len(tok), "bos_id": bos_id,
                      "separator_id": separator_id, "special_ids": list(specials)},
        "input": source.identity(reading),
        "width": width,
    }
    summary = ActivationSummary(store=str(output))
    recorded = (recorded_runtime(read_json(Path(output) / MANIFEST))
                if not overwrite and is_activation_store(output) else None)
    encode_spec = EncodeSpec(layers=list(layer_ids), site=site, level="token", combine="stack").resolve(ex)
    runtime = store_runtime(ex, encode_spec, recorded=recorded, records=source.count, tokens_per_record=context_size)
    header["runtime"] = runtime
    writer = ActivationWriter(output, header)
    state = writer.open(overwrite)
    summary.repairs = list(writer.repairs)
    summary.runtime = runtime["name"]
    try:
        if state == "complete":
            summary.status = "already_complete"
            summary.total_contexts = writer.done_contexts
            return summary
        summary.resumed_from = writer.done_contexts
        with contextlib.ExitStack() as stack:
            if engine == "ray":
                compute: Any = stack.enter_context(RayCompute(
                    ex.options, runtime, spec, num_workers=num_workers, cpus_per_worker=cpus_per_worker,
                    gpus_per_worker=gpus_per_worker, address=address))
            else:
                stack.enter_context(pinned(ex, runtime))
                compute = LocalCompute(ex, layer_ids, site, dtype)
            _run(ex, spec, source, reading, writer, summary, compute, bos_id=bos_id, separator_id=separator_id,
                 batch_tokens=batch_tokens, shard_bytes=shard_bytes, max_contexts=max_contexts, strict=strict,
                 progress=progress)
    finally:
        writer.close()
    summary.seconds = time.perf_counter() - started
    return summary


def _run(ex: Extractor, spec: ContextSpec, source: Any, reading: ReadOptions, writer: ActivationWriter,
         summary: ActivationSummary, compute: Any, *, bos_id: int | None, separator_id: int | None,
         batch_tokens: int | None, shard_bytes: int, max_contexts: int | None, strict: bool,
         progress: bool | None) -> None:
    """The three stages (module docstring) from the store's resume point to the end of the input."""
    layers, size = spec.layers, spec.context_size
    width = int(writer.header["width"])
    budget = check_budget(ex.batch_tokens if batch_tokens is None else batch_tokens)
    cap = compute.batch_tokens_cap()
    if cap is not None:
        budget = min(budget, cap)
    batch = max(1, budget // size)
    per_shard = max(1, shard_bytes // max(1, batch * size * spec.row_bytes(width))) * batch
    done = writer.done_contexts
    packer = ContextPacker(size, bos_id, separator_id, skip=writer.consumed)
    limit = None if max_contexts is None else max(0, max_contexts - done)
    pin = compute.pin
    shards = [_Shard(per_shard, size, layers, width, spec.dtype, pin) for _ in range(2)]
    fidelity = _Fidelity()
    recorded_fidelity = dict(writer.manifest.get("fidelity") or {})  # a resumed store's, merged with this run's
    errors: list[BadRecord] = []
    batches: "queue.Queue[Any]" = queue.Queue(maxsize=4)
    to_write: "queue.Queue[Any]" = queue.Queue()
    stop = threading.Event()
    failure: list[BaseException] = []
    logged = [0]

    def counts(status: str, consumed: int) -> dict[str, Any]:
        return {"stream_tokens": consumed, "left_over": packer.left_over if status == "complete" else 0,
                "skipped": int((writer.manifest.get("counts") or {}).get("skipped", 0)) + logged[0]}

    def write_loop() -> None:
        while True:
            shard = to_write.get()
            if shard is None:
                return
            try:
                if not failure:
                    for bad in errors[logged[0]:]:
                        writer.log_error(bad.line, bad.reason)
                        logged[0] += 1
                    summary.bytes_written += writer.write_shard(
                        shard.ids[: shard.filled], {k: shard.bits(k) for k in layers},
                        {k: s[: shard.filled * size].numpy() for k, s in shard.scales.items()},
                        consumed=shard.consumed, first_line=shard.first_line, last_line=shard.last_line,
                        runtime=summary.runtime)
                    summary.shards_written += 1
                    writer.write_manifest("running", counts("running", shard.consumed),
                                          fidelity=fidelity.report(recorded_fidelity))
            except BaseException as exc:  # the compute stops at its next batch and raises it
                failure.append(exc)
            finally:
                shard.done.set()

    producer = threading.Thread(target=_producer, name="layerwise-pack", daemon=True,
                                args=(source, reading, ex.tokenizer, packer, batch, batches, stop, errors, limit))
    writing = threading.Thread(target=write_loop, name="layerwise-write", daemon=True)
    producer.start()
    writing.start()
    current = 0
    shard = shards[current]
    shard.filled = 0
    in_flight: list[tuple[_Batch, Any]] = []
    ahead = compute.ahead
    bar = progress_bar(progress, total=None, initial=done * size, desc="activations", unit="tok")

    def hand_over() -> None:
        nonlocal current, shard
        if pin:
            torch.cuda.current_stream().synchronize()
        shard.consumed = (done + summary.contexts) * packer.take
        shard.done.clear()
        to_write.put(shard)
        current = 1 - current
        shard = shards[current]
        shard.done.wait()  # the other buffer's write has finished
        if failure:
            raise failure[0]
        shard.filled = 0

    def finish_one() -> None:
        b, wait = in_flight.pop(0)
        converted = wait()
        n = len(b.ids)
        if shard.filled == 0:
            shard.first_line = b.first_line
        _place(converted, layers, shard, shard.filled * size, fidelity)
        shard.ids[shard.filled : shard.filled + n] = b.ids
        shard.filled += n
        shard.last_line = b.last_line
        summary.contexts += n
        summary.tokens += n * size
        bar.update(n * size)
        if shard.filled + batch > shard.capacity:
            hand_over()

    try:
        while True:
            item = batches.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                raise item
            if strict and errors:
                raise ExtractError(f"line {errors[0].line}: {errors[0].reason} (strict: the run stops at a bad "
                                   f"record; without --strict it is logged and skipped)")
            if failure:
                raise failure[0]
            in_flight.append((item, compute.start(item.ids)))
            if len(in_flight) >= ahead:
                finish_one()
        while in_flight:
            finish_one()
        if shard.filled:
            hand_over()
        to_write.put(None)
        writing.join()
        if failure:
            raise failure[0]
        partial = max_contexts is not None and writer.done_contexts >= max_contexts
        status = "partial" if partial else "complete"
        for bad in errors[logged[0]:]:
            writer.log_error(bad.line, bad.reason)
            logged[0] += 1
        summary.skipped = logged[0]
        summary.left_over = packer.left_over if not partial else 0
        summary.total_contexts = writer.done_contexts
        summary.fidelity = fidelity.report(recorded_fidelity)
        writer.write_manifest(status, counts(status, writer.consumed), fidelity=summary.fidelity)
        summary.status = status
        if spec.dtype == "float8" and summary.fidelity:
            worst = min(v["cosine_mean"] for v in summary.fidelity.values())
            notice(f"float8 e4m3 keeps a mean cosine of {worst:.5f} to float32 (the worst stored layer; per layer in "
                   f"the manifest's fidelity)")
    finally:
        stop.set()
        bar.close()
        if writing.is_alive():
            to_write.put(None)
            writing.join(timeout=60)
        while producer.is_alive():  # unblock a producer waiting on a full queue
            try:
                batches.get_nowait()
            except queue.Empty:
                producer.join(timeout=0.1)


__all__ = ["ActivationSummary", "extract_activations"]
