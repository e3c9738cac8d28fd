"""The weights on disk: a safetensors checkpoint's tensors, read from the headers alone, and each tensor
memory-mapped on demand.

:class:`Checkpoint` reads ``model.safetensors.index.json`` (or every ``*.safetensors`` file of the directory) and the
8-byte length + JSON header of each shard: the name, dtype, shape and byte range of every tensor, without reading a
weight. So the bytes a depth needs are known before anything is loaded (:meth:`Checkpoint.nbytes`), and a tensor is
a view of the file's pages (:meth:`Checkpoint.tensor`): the kernel reads it when it is used and may drop it again, so
a block taken from the checkpoint costs page cache, not private memory.

Example::

    >>> from layerwise.model.loading import default_model_path
    >>> ck = Checkpoint.open(default_model_path())
    >>> ck.dtype, ck.tensor("embeddings.word_embeddings.weight").shape
    (torch.float32, torch.Size([30522, 384]))
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from ..errors import ModelLoadError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_HEADER_LIMIT = 100 * 2**20  # safetensors refuses headers over 100 MB too


@dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its ``file``, ``dtype``, ``shape`` and byte range ``[start, end)`` in the file."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self.end - self.start


def _damaged(path: Path, reason: str) -> ModelLoadError:
    return ModelLoadError(f"the weights in {path} are not a readable safetensors file ({reason}); the file is corrupt "
                          f"or truncated: download or save the model again")


def _read_header(path: Path) -> dict[str, Entry]:
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            text = f.read(size) if 0 <= size <= _HEADER_LIMIT else b""
        total = path.stat().st_size
    except OSError as exc:
        raise _damaged(path, str(exc)) from exc
    if size < 0:
        raise _damaged(path, "shorter than its 8-byte header length")
    if size > _HEADER_LIMIT:
        raise _damaged(path, f"it claims a {size:,}-byte header")
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise _damaged(path, f"its header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise _damaged(path, "its header is not a JSON object")
    entries: dict[str, Entry] = {}
    base = 8 + size
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (base + int(x) for x in info["data_offsets"])
            entry = Entry(path, DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"]), start, end)
        except (KeyError, TypeError, ValueError) as exc:
            raise _damaged(path, f"tensor {name!r} has a malformed header entry {info!r}") from exc
        if end > total:
            raise _damaged(path, f"tensor {name!r} ends at byte {end:,} and the file has {total:,}")
        entries[name] = entry
    return entries


class Checkpoint:
    """The tensors of a local safetensors checkpoint (one file, or shards listed by an index).

    Args:
        files: the ``*.safetensors`` files.
    """

    def __init__(self, files: Iterable[Path]):
        self.files = sorted(set(files))
        self.entries: dict[str, Entry] = {}
        for path in self.files:
            self.entries.update(_read_header(path))
        self._maps: dict[Path, mmap.mmap] = {}

    @classmethod
    def open(cls, directory: str | Path) -> "Checkpoint":
        """The checkpoint of a model directory: the shards its ``model.safetensors.index.json`` names, else its
        ``*.safetensors`` files.

        Raises:
            ModelLoadError: no safetensors file, a shard the index names that is missing, a damaged header.
        """
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
            except (OSError, json.JSONDecodeError, KeyError, AttributeError) as exc:
                raise ModelLoadError(f"could not read {index}: {exc}; the file is damaged") from exc
            missing = sorted(n for n in names if not (directory / n).is_file())
            if missing:
                raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}; download or "
                                     f"save the model again")
            files = [directory / n for n in names]
        elif (directory / "model.safetensors").is_file():  # what transformers reads without an index
            files = [directory / "model.safetensors"]
        else:
            files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
        if not files:
            raise ModelLoadError(f"{directory} has no *.safetensors weights")
        return cls(files)

    @property
    def dtype(self) -> torch.dtype:
        """The floating dtype most of the checkpoint's bytes are in (how the weights are held in memory)."""
        counts: Counter[torch.dtype] = Counter()
        for e in self.entries.values():
            if e.dtype.is_floating_point:
                counts[e.dtype] += e.nbytes
        return counts.most_common(1)[0][0] if counts else torch.float32

    @property
    def total_bytes(self) -> int:
        """Bytes of every tensor."""
        return sum(e.nbytes for e in self.entries.values())

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a read-only view of the file's pages (nothing is read until it is used; never write
        into it: every write goes through a copy, e.g. ``.to(dtype)`` or ``.clone()``).

        Raises:
            KeyError: the checkpoint has no such tensor.
        """
        e = self.entries[name]
        mapped = self._maps.get(e.file)
        if mapped is None:
            with e.file.open("rb") as f:
                mapped = self._maps[e.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        count = 1
        for d in e.shape:
            count *= d
        if count == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        with warnings.catch_warnings():  # "the given buffer is not writable": it is read only, by design
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapped, dtype=e.dtype, count=count, offset=e.start)
        return flat.view(e.shape)

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process's mapping (``MADV_DONTNEED``) and from the page cache
        (``POSIX_FADV_DONTNEED``) once it has been copied or used: under a cgroup memory limit the page cache counts
        against the limit too, and a streamed block is read again from the file for the next chunk anyway."""
        e = self.entries[name]
        mapped = self._maps.get(e.file)
        advise = getattr(mmap, "MADV_DONTNEED", None)
        if mapped is None or advise is None:
            return
        page = mmap.PAGESIZE
        start, end = -(-e.start // page) * page, e.end // page * page  # whole pages inside the tensor only
        if end > start:
            mapped.madvise(advise, start, end - start)
            if hasattr(os, "posix_fadvise"):  # and out of the page cache: under a memory limit it counts too
                fd = os.open(e.file, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

    def close(self) -> None:
        """Unmap the files (tensors taken from them must no longer be used)."""
        for mapped in self._maps.values():
            try:
                mapped.close()
            except BufferError:  # a tensor still views it: the mapping goes when the tensor does
                pass
        self._maps.clear()


__all__ = ["DTYPES", "Checkpoint", "Entry"]
