"""Blocks moved to a GPU ahead of their turn: how a model larger than GPU memory streams (``device="cuda"`` with
``max_memory``, which on a GPU is the GPU memory the model may take).

A layer-by-layer run (:func:`layerwise.model.capture.capture_chunk`) takes block ``m`` while block ``m + 1`` is
already on its way. A worker thread copies ``m + 1``'s tensors from the checkpoint's memory-mapped pages into
page-locked (pinned) host memory, and a copy stream moves them to the GPU asynchronously, so the transfer overlaps
block ``m``'s compute on the model's stream. Two GPU slots alternate (the block running, the next one), and CUDA events
order the two streams: a copy into a slot waits for the compute that last used the slot, and a block's compute waits
for its copy. Nothing here blocks the host on the GPU, except the reuse of a pinned staging buffer whose previous copy
has not finished.

Host side: when the streamed blocks take at most :data:`HOST_SHARE` of the memory this process may still use
(:func:`layerwise.model.memory.available`), each block's pinned copy is kept after its first read, so later chunks
stream from CPU memory at the bus's speed and the checkpoint is read once. Otherwise two pinned staging buffers
alternate, filled again from the checkpoint for every chunk. :meth:`GpuFeed.describe` says which.

Example::

    >>> ex = lw.Extractor("path/to/llama", device="cuda", max_memory="8GB")  # doctest: +SKIP
    >>> ex.describe()["weights"]["transfer"]                                  # doctest: +SKIP
    {'host': 'pinned copies kept in CPU memory', 'taken': 0, 'prefetched': 0, 'bytes_read': 0, ...}
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .memory import available

HOST_SHARE = 0.5  # pinned host copies are kept when the streamed blocks take at most this share of free memory
_ALIGN = 64  # bytes: each tensor's offset in a block's pinned buffer (any dtype's view needs its own alignment)


@dataclass
class Source:
    """One tensor of a block about to be given weights: where it goes (``owner.attr``), where it comes from (``key``
    in the checkpoint, or ``None`` for a buffer the file lacks, taken from block 0), the ``source`` tensor (a view of
    the file's pages, or block 0's buffer) and the ``dtype`` it is held in."""

    name: str
    owner: nn.Module
    attr: str
    is_param: bool
    key: str | None
    source: torch.Tensor
    dtype: torch.dtype


def buffer_layout(sources: Sequence[Source]) -> tuple[dict[str, int], int]:
    """Where each file tensor of ``sources`` sits in a block's one host buffer: ``({name: byte offset}, total
    bytes)``, each offset a multiple of :data:`_ALIGN` (buffers, ``key=None``, are not in it)."""
    offsets, total = {}, 0
    for s in sources:
        if s.key is None:
            continue
        offsets[s.name] = total
        total += -(-s.source.numel() * s.source.element_size() // _ALIGN) * _ALIGN
    return offsets, total


def _pinned(sources: Sequence[Source], pin: bool = True) -> dict[str, torch.Tensor]:
    """One page-locked buffer (``pin=False``: a plain one) holding every file tensor of ``sources``: ``{name: view
    [shape] in the file's dtype}`` at :func:`buffer_layout`'s offsets."""
    offsets, total = buffer_layout(sources)
    flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
    views = {}
    for s in sources:
        if s.key is not None:
            n = s.source.numel() * s.source.element_size()
            start = offsets[s.name]
            views[s.name] = flat[start:start + n].view(s.source.dtype).view(s.source.shape)
    return views


def keeps_host_copies(streamed_bytes: int, free_bytes: int | None) -> bool:
    """Whether each streamed block's pinned copy is kept after its first read: when the streamed blocks take at most
    :data:`HOST_SHARE` of the memory this process may still use (``free_bytes``; ``None``: unknown, so not)."""
    return free_bytes is not None and streamed_bytes <= HOST_SHARE * free_bytes


def _fits(views: dict[str, torch.Tensor], sources: Sequence[Source]) -> bool:
    return all(s.name in views and views[s.name].shape == s.source.shape and views[s.name].dtype == s.source.dtype
               for s in sources if s.key is not None)


class GpuFeed:
    """Streamed blocks copied to ``device`` one ahead of their use (see the module's docstring).

    Args:
        device: the CUDA device the model runs on.
        streamed_bytes: bytes of the blocks that will be streamed (for the host-side choice).
        release: called with a checkpoint key once its tensor has been copied out of the file's pages.
    """

    def __init__(self, device: torch.device, streamed_bytes: int, release: Any):
        self.device = device
        self.release = release
        self.copy_stream = torch.cuda.Stream(device)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="layerwise-to-gpu")
        host = available("cpu")
        self.keep_host = keeps_host_copies(streamed_bytes, None if host is None else host.bytes)
        self.host: dict[int, dict[str, torch.Tensor]] = {}  # block -> its pinned copy (kept, keep_host only)
        self.staging: list[dict[str, torch.Tensor]] = [{}, {}]  # per slot: a pinned buffer reused (not keep_host)
        self.gpu: list[dict[str, torch.Tensor]] = [{}, {}]  # per slot: the block's tensors on the GPU
        self.copied: list[torch.cuda.Event | None] = [None, None]  # per slot: its last copy to the GPU is done
        self.freed: list[torch.cuda.Event | None] = [None, None]  # per slot: the compute that used it is done
        self.pending: dict[int, Future] = {}
        self.bytes_read = 0  # from the checkpoint into pinned memory
        self.bytes_to_gpu = 0
        self.taken = 0  # streamed blocks given to the model
        self.prefetched = 0  # of them, those found already moving when their turn came (the overlap at work)
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        """``{"host": how blocks reach the GPU, "taken": streamed blocks run, "prefetched": of them,
        those already moving when their turn came, "bytes_read": from the checkpoint, "bytes_to_gpu": copied to the
        GPU}``."""
        host = "pinned copies kept in CPU memory" if self.keep_host else \
            "read from the checkpoint into two pinned staging buffers per chunk"
        return {"host": host, "taken": self.taken, "prefetched": self.prefetched,
                "bytes_read": self.bytes_read, "bytes_to_gpu": self.bytes_to_gpu}

    def fetch(self, m: int, sources: Sequence[Source]) -> None:
        """Start moving block ``m`` (its ``sources``) to the GPU, in the background; no-op when already started."""
        if m in self.pending:
            return
        slot = m % 2
        for stale in [k for k in self.pending if k % 2 == slot]:  # left by a run that stopped: its slot is retaken
            self.pending.pop(stale).result()
        self.pending[m] = self.pool.submit(self._move, m, slot, list(sources), self.freed[slot])

    def take(self, m: int, sources: Sequence[Source]) -> tuple[dict[str, torch.Tensor], int]:
        """Block ``m``'s tensors on the GPU (``{name: tensor}``), with the current stream made to wait for their copy;
        and the bytes read from the checkpoint for it (0 when its pinned copy was kept)."""
        self.taken += 1
        if m in self.pending:
            self.prefetched += 1
        self.fetch(m, sources)
        ready, read = self.pending.pop(m).result()
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)
        tensors = self.gpu[m % 2]
        for t in tensors.values():  # allocated on the copy stream, used on this one
            t.record_stream(stream)
        return tensors, read

    def done(self, m: int) -> None:
        """Block ``m``'s compute has been queued: its slot may be overwritten once that compute has run."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.freed[m % 2] = event

    def _move(self, m: int, slot: int, sources: list[Source], freed: torch.cuda.Event | None
              ) -> tuple[torch.cuda.Event, int]:
        read = 0
        with self._lock:
            host = self.host.get(m)
            if host is None:
                if self.keep_host:
                    host = _pinned(sources)
                else:
                    last = self.copied[slot]
                    if last is not None:  # the staging buffer's last copy must be finished
                        last.synchronize()
                    if not _fits(self.staging[slot], sources):
                        self.staging[slot] = _pinned(sources)
                    host = self.staging[slot]
                for s in sources:
                    if s.key is not None:
                        host[s.name].copy_(s.source)
                        read += s.source.numel() * s.source.element_size()
                        self.release(s.key)
                if self.keep_host:
                    self.host[m] = host
            gpu = self.gpu[slot]
            with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
                if freed is not None:
                    self.copy_stream.wait_event(freed)
                for s in sources:
                    src = host[s.name] if s.key is not None else s.source
                    dst = gpu.get(s.name)
                    if dst is None or dst.shape != src.shape or dst.dtype != s.dtype:
                        dst = gpu[s.name] = torch.empty(src.shape, dtype=s.dtype, device=self.device)
                    if src.dtype == s.dtype:
                        dst.copy_(src, non_blocking=True)
                    else:  # moved in the file's dtype, converted on the GPU
                        dst.copy_(src.to(self.device, non_blocking=True))
                    self.bytes_to_gpu += src.numel() * src.element_size()
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            self.copied[slot] = ready
            self.bytes_read += read
        return ready, read

    def close(self) -> None:
        """Stop the worker and free the pinned and GPU buffers."""
        self.pool.shutdown(wait=True)
        self.pending.clear()
        self.host.clear()
        self.staging = [{}, {}]
        self.gpu = [{}, {}]


__all__ = ["HOST_SHARE", "GpuFeed", "Source", "buffer_layout", "keeps_host_copies"]
