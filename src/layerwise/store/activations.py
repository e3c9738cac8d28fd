"""A token-activation store: the on-disk format of token activations in fixed-length contexts, one array per layer,
for sparse-autoencoder trainers (``layerwise extract --context-size N``). Imports no torch.

A store is a directory::

    STORE/
      manifest.json             what, from what, how many; every shard with its size and sha256
      shard-000000.safetensors  C contexts of N tokens:
                                  token_ids  [C, N]      int32
                                  layer.K    [C * N, W]  F32 | F16 | BF16 | F8_E4M3   (one tensor per layer K)
                                  scale.K    [C * N]     F32   (float8 only: value = e4m3 * scale, per token)
      errors.jsonl              records that could not be read: {"line": 12, "reason": "..."}

Each layer is its own tensor, so a reader maps one layer's bytes without touching the others; the bytes on disk are
tokens x layers x width x the dtype's size (plus float8's scales, the token ids, the shards' headers and the
manifest). Any safetensors reader reads a shard (``safetensors.torch.load_file`` gives bfloat16 and float8 tensors);
the shards carry a seal, the store's id and their index as the feature store's do
(:mod:`layerwise.store.layout`).

The manifest (``format: layerwise-activations``) holds ``spec`` (:class:`~layerwise.encoding.contexts.ContextSpec`),
``model`` (name, weights fingerprint, layers, widths), ``model_options``, ``runtime`` (what computed it), ``tokenizer``
(class, vocabulary size, ``bos_id``, ``separator_id``, ``special_ids``), ``input`` (path, format, sha256), ``width``,
``status`` (``running | complete``), ``counts`` (``contexts``, ``tokens``, ``stream_tokens``, ``left_over``,
``skipped``), ``fidelity`` (float8: the cosine of every stored token against its float32 value, mean and minimum, per
layer) and the ``shards`` (``file``, ``contexts``, ``consumed``: stream tokens packed up to its end, ``first_line``,
``last_line``, ``bytes``, ``sha256``).

One writer at a time (the feature store's lock, :mod:`layerwise.store.lock`); a rerun of the same command resumes
after the last finished shard (every listed shard's sha256 checked first; from the first damaged one on, shards are
recomputed), a rerun with other options is refused naming them, unless ``overwrite``.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np

from ..encoding.contexts import ContextSpec
from ..errors import StoreCorruptError, StoreError
from ..provenance import differences, now, stamp
from .layout import (
    ERRORS,
    MANIFEST,
    ShardFile,
    file_sha256,
    guard_full,
    list_shards,
    read_json,
    remove_temporaries,
    shard_index,
    shard_name,
    write_json,
    write_shard,
)
from .lock import StoreLock
from .manifest import ACTIVATIONS

FORMAT = ACTIVATIONS
FORMAT_VERSION = 1
# a layer's values and scales inside a shard; the safetensors dtype of each activation dtype
KINDS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8": "F8_E4M3"}
# the fields of a header that shape the bytes (a resume must match them); the rest is provenance
IDENTITY = ("spec", "tokenizer", "width")
MODEL_IDENTITY = ("fingerprint", "num_layers")
INPUT_IDENTITY = ("sha256", "format", "text_field", "rows", "header")

OpenState = Literal["new", "resume", "complete"]


def values_name(layer: int) -> str:
    """The tensor of layer ``layer``'s values in a shard."""
    return f"layer.{layer}"


def scale_name(layer: int) -> str:
    """The tensor of layer ``layer``'s float8 scales in a shard."""
    return f"scale.{layer}"


def is_activation_store(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory whose manifest says it is a token-activation store."""
    mpath = Path(path) / MANIFEST
    try:
        return mpath.is_file() and read_json(mpath).get("format") == FORMAT
    except (StoreCorruptError, AttributeError):
        return False


def _identity(header: dict[str, Any]) -> dict[str, Any]:
    out = {k: header.get(k) for k in IDENTITY}
    out["model"] = {k: (header.get("model") or {}).get(k) for k in MODEL_IDENTITY}
    out["input"] = {k: (header.get("input") or {}).get(k) for k in INPUT_IDENTITY}
    return out


class ActivationWriter:
    """One token-activation store being written (see the module docstring).

    Args:
        path: the store directory (created if absent).
        header: ``spec`` (a :class:`ContextSpec`'s dict), ``model``, ``model_options``, ``runtime``, ``tokenizer``,
            ``input`` and ``width`` of the run (JSON-ready).
    """

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any]):
        self.path = Path(path)
        self.header = header
        self.manifest: dict[str, Any] = {}
        self.shards: list[dict[str, Any]] = []
        self.repairs: list[str] = []
        self._next = 0
        self._lock = StoreLock(self.path)

    def open(self, overwrite: bool = False) -> OpenState:
        """Take the lock and prepare the directory: ``new``, ``resume`` (same header, unfinished or repaired) or
        ``complete`` (same header, finished, every shard's sha256 checked).

        Raises:
            StoreError: a file, a directory that is not a layerwise store, a store another process writes, or a store
                made with other options (named) without ``overwrite``.
        """
        store, mpath = self.path, self.path / MANIFEST
        if store.exists() and not store.is_dir():
            raise StoreError(f"store path {str(store)!r} is a file; give a directory (new or a layerwise store)")
        if store.is_dir() and any(store.iterdir()) and not is_activation_store(store):
            what = ("a feature store (layerwise extract without --context-size)" if mpath.is_file()
                    else "not a layerwise token-activation store")
            raise StoreError(f"{str(store)!r} exists, is not empty and is {what}: choose a new or empty directory "
                             f"(layerwise replaces only its own token-activation stores, with --overwrite)")
        store.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            return self._open_locked(overwrite)
        except BaseException:
            self.close()
            raise

    def _open_locked(self, overwrite: bool) -> OpenState:
        store, mpath = self.path, self.path / MANIFEST
        if mpath.exists():
            old = read_json(mpath)
            diffs = differences(_identity(old), _identity(self.header))
            if diffs and not overwrite:
                raise StoreError(f"{str(store)!r} holds token activations made with other options ({'; '.join(diffs)})"
                                 f": give another output directory, or pass --overwrite to recompute it")
            if not diffs and not overwrite:
                self.manifest = old
                remove_temporaries(store)
                return self._resume()
            for p in list_shards(store):
                p.unlink()
            remove_temporaries(store)
            (store / ERRORS).unlink(missing_ok=True)
        self.manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "id": uuid.uuid4().hex, **stamp(),
                         "status": "running", **copy.deepcopy(self.header), "counts": {}, "shards": []}
        self._next = self._free_index()
        self.write_manifest("running", {})
        return "new"

    def _resume(self) -> OpenState:
        """Keep the listed shards up to the first missing or damaged one (its sha256), recompute from there."""
        entries = [dict(e) for e in self.manifest.get("shards", [])]
        keep = len(entries)
        for i, entry in enumerate(entries):
            path = self.path / entry["file"]
            problem = ("is missing" if not path.is_file() else
                       f"has {path.stat().st_size} bytes, not {entry['bytes']}" if path.stat().st_size != entry["bytes"]
                       else "does not match its sha256" if file_sha256(path) != entry["sha256"] else None)
            if problem:
                self.repairs.append(f"{entry['file']} {problem}: recomputing from it")
                keep = i
                break
        for entry in entries[keep:]:
            path = self.path / entry["file"]
            if path.is_file() and file_sha256(path) == entry["sha256"]:
                path.unlink()
            elif path.is_file():
                self.repairs.append(f"{entry['file']} is left as it is (damaged, no longer listed); delete it once "
                                    f"you no longer need it")
        self.shards = entries[:keep]
        self._next = self._free_index()
        if keep < len(entries):
            self.write_manifest("running", self.manifest.get("counts") or {})
            return "resume"
        return "complete" if self.manifest.get("status") == "complete" else "resume"

    def _free_index(self) -> int:
        used = [shard_index(p.name) for p in list_shards(self.path)] + [shard_index(e["file"]) for e in self.shards]
        return max(used, default=-1) + 1

    def close(self) -> None:
        """Let the store's lock go; nothing when not open."""
        self._lock.release()

    def __enter__(self) -> "ActivationWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def done_contexts(self) -> int:
        """Contexts in finished shards."""
        return sum(int(s["contexts"]) for s in self.shards)

    @property
    def consumed(self) -> int:
        """Stream tokens packed into the finished shards' contexts (a resume skips them)."""
        return int(self.shards[-1]["consumed"]) if self.shards else 0

    def write_shard(self, token_ids: np.ndarray, layers: dict[int, np.ndarray], scales: dict[int, np.ndarray], *,
                    consumed: int, first_line: int, last_line: int, runtime: str) -> int:
        """Write the next shard: ``token_ids [C, N]`` int32, each layer's values ``[C * N, W]`` (the raw bits of
        bfloat16 as uint16, of float8 e4m3 as uint8) and float8's ``[C * N]`` scales; list it in the manifest.
        Returns its size in bytes.

        Raises:
            StoreFullError: no space left (the finished shards are safe; the same command resumes).
        """
        while (self.path / shard_name(self._next)).exists():
            self._next += 1
        index, name = self._next, shard_name(self._next)
        kind = KINDS[self.header["spec"]["dtype"]]
        tensors: dict[str, np.ndarray] = {"token_ids": token_ids}
        kinds: dict[str, str] = {}
        for k, values in layers.items():
            tensors[values_name(k)] = values
            kinds[values_name(k)] = kind
        for k, scale in scales.items():
            tensors[scale_name(k)] = scale
        meta = {"store": self.manifest["id"], "shard": str(index), "format": FORMAT, "runtime": runtime,
                "first_line": str(first_line), "last_line": str(last_line), "consumed": str(consumed)}
        written = self._guard(lambda: write_shard(self.path / name, tensors, meta, kinds=kinds), name)
        self._next += 1
        self.shards.append({"file": name, "contexts": int(token_ids.shape[0]), "consumed": int(consumed),
                            "first_line": int(first_line), "last_line": int(last_line), "bytes": written.bytes,
                            "sha256": written.sha256, "runtime": runtime})
        return written.bytes

    def log_error(self, line: int, reason: str) -> None:
        """Append a record that could not be read to ``errors.jsonl``."""
        entry = json.dumps({"line": line, "reason": reason}, ensure_ascii=False) + "\n"

        def append() -> None:
            with open(self.path / ERRORS, "a", encoding="utf-8") as fh:
                fh.write(entry)

        self._guard(append, ERRORS)

    def write_manifest(self, status: str, counts: dict[str, Any], **fields: Any) -> None:
        """Rewrite the manifest (atomically) with ``status``, the shards, ``counts`` and any other ``fields``."""
        m = self.manifest
        m.update(status=status, updated=now(), shards=self.shards, **fields)
        size = int(self.header["spec"]["context_size"])
        m["counts"] = {**counts, "contexts": self.done_contexts, "tokens": self.done_contexts * size}
        self._guard(lambda: write_json(self.path / MANIFEST, m), MANIFEST)

    def _guard(self, write: Any, what: str) -> Any:
        safe = f"{self.done_contexts} contexts in {len(self.shards)} finished shards"
        return guard_full(write, what, self.path, safe)


class ActivationStore:
    """A token-activation store opened for reading: memory-mapped, one layer at a time.

    Attributes:
        path: the directory. manifest: its manifest. spec: the :class:`ContextSpec`. layers: the stored layers.
        width: ``W``. context_size: ``N``. num_contexts, num_tokens: how many stored.

    Raises:
        StoreError: not a token-activation store. StoreCorruptError: a listed shard missing or of the wrong size.

    Example::

        >>> store = ActivationStore("acts")                                        # doctest: +SKIP
        >>> for batch in store.token_loader(layer=8, batch_size=4096, seed=0):     # doctest: +SKIP
        ...     loss = sae(batch)                                                  # [4096, W] float32
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not is_activation_store(self.path):
            raise StoreError(f"{os.fspath(path)!r} is not a token-activation store (no {MANIFEST} of format "
                             f"{FORMAT!r}); make one with layerwise extract INPUT -o STORE --level token "
                             f"--context-size 128")
        self.manifest: dict[str, Any] = read_json(self.path / MANIFEST)
        self.spec = ContextSpec.from_dict(self.manifest["spec"])
        self.layers: tuple[int, ...] = self.spec.layers
        self.width = int(self.manifest["width"])
        self.context_size = self.spec.context_size
        self.entries: list[dict[str, Any]] = list(self.manifest.get("shards", []))
        for e in self.entries:
            p = self.path / e["file"]
            size = p.stat().st_size if p.is_file() else None
            if size != e["bytes"]:
                what = "missing" if size is None else f"{size} bytes, not {e['bytes']}"
                raise StoreCorruptError(
                    f"shard {str(p)!r} is {what}: rerun "
                    f"the extract command (it resumes and recomputes it) or restore the file",
                    file=str(p), problem="size")
        self._files: dict[int, ShardFile] = {}

    # ---- facts -------------------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """Whether the run that wrote it finished (``status == "complete"``)."""
        return self.manifest.get("status") == "complete"

    @property
    def num_contexts(self) -> int:
        """Contexts stored (``C`` over every shard)."""
        return sum(int(e["contexts"]) for e in self.entries)

    @property
    def num_tokens(self) -> int:
        """Token rows stored per layer: ``num_contexts * context_size``."""
        return self.num_contexts * self.context_size

    @property
    def dtype(self) -> str:
        """The stored dtype: ``float32 | float16 | bfloat16 | float8``."""
        return self.spec.dtype

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The tokenizer's special ids (the rows :meth:`token_loader` leaves out with ``skip_special``)."""
        return tuple(int(i) for i in (self.manifest.get("tokenizer") or {}).get("special_ids", ()))

    @property
    def nbytes(self) -> int:
        """The shards' bytes on disk."""
        return sum(int(e["bytes"]) for e in self.entries)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"ActivationStore({str(self.path)!r}, tokens={self.num_tokens:,}, contexts={self.num_contexts:,} x "
                f"{self.context_size}, layers={list(self.layers)}, site={self.spec.site!r}, width={self.width}, "
                f"dtype={self.dtype!r}, status={self.manifest.get('status')!r})")

    # ---- arrays ------------------------------------------------------------------------------------------
    def shard(self, s: int) -> ShardFile:
        """Shard ``s`` (its header read once)."""
        if s not in self._files:
            self._files[s] = ShardFile(self.path / self.entries[s]["file"])
        return self._files[s]

    def check_layer(self, layer: int) -> int:
        """``layer`` if stored (negative counts from the end of :attr:`layers`), else a :class:`StoreError`."""
        if isinstance(layer, int) and not isinstance(layer, bool):
            if layer in self.layers:
                return layer
            if -len(self.layers) <= layer < 0:
                return self.layers[layer]
        raise StoreError(f"layer {layer!r} is not in this store; it holds layers {list(self.layers)} (model numbering; "
                         f"-1 is the last stored)")

    def layer_arrays(self, layer: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each shard's ``(values [rows, W] as stored bits, float8 scales [rows] | None)`` of ``layer``, memory
        mapped (no copy)."""
        layer = self.check_layer(layer)
        out = []
        for s in range(len(self.entries)):
            f = self.shard(s)
            scale = f.array(scale_name(layer)) if scale_name(layer) in f else None
            out.append((f.array(values_name(layer)), scale))
        return out

    def token_id_arrays(self) -> list[np.ndarray]:
        """Each shard's token ids ``[rows]`` int32 (mapped), in store order."""
        return [self.shard(s).array("token_ids").reshape(-1) for s in range(len(self.entries))]

    def token_ids(self) -> np.ndarray:
        """Every context's token ids ``[contexts, N]`` int32 (a copy)."""
        parts = [self.shard(s).array("token_ids") for s in range(len(self.entries))]
        return np.concatenate(parts) if parts else np.zeros((0, self.context_size), np.int32)

    def to_numpy(self, layer: int) -> np.ndarray:
        """Layer ``layer`` of every token as float32 ``[tokens, W]`` (a copy: for small stores and checks; read a
        large one with :meth:`token_loader`)."""
        from .token_loader import decode

        arrays = self.layer_arrays(layer)
        if not arrays:
            return np.zeros((0, self.width), np.float32)
        return np.concatenate([decode(values, scale, self.dtype) for values, scale in arrays])

    def iter_shards(self) -> Iterator[int]:
        """The listed shards' indexes, in store order."""
        return iter(range(len(self.entries)))

    # ---- reading for training ----------------------------------------------------------------------------
    def token_loader(self, layer: int = -1, batch_size: int = 4096, *, shuffle: bool = True, seed: int = 0,
                     start: int = 0, epoch: int = 0, dtype: str = "float32", skip_special: bool | None = None,
                     drop_last: bool = False) -> Any:
        """Batches of one layer's token rows as torch tensors ``[batch, W]``, read by memory map
        (:class:`~layerwise.store.token_loader.TokenLoader`).

        Args:
            layer: a stored layer (model numbering; -1: the last stored).
            batch_size: rows per batch (fewer where special tokens are left out, and in the last batch).
            shuffle: a global token-level shuffle across every shard, the same for the same ``seed`` and ``epoch``.
            seed, epoch: the shuffle's key (each epoch its own order).
            start: the first batch to give (a training run that restarts: ``loader.state_dict()["batch"]``).
            dtype: ``float32`` (decoded) or ``stored`` (``float16``, ``torch.bfloat16`` as stored; float8 refused).
            skip_special: leave out the special tokens' rows (default: the store's ``skip_special``).
            drop_last: give full batches only.
        """
        from .token_loader import RowSource, TokenLoader

        ids = self.token_id_arrays()
        sources = [RowSource(values, scale, tokens) for (values, scale), tokens in zip(self.layer_arrays(layer), ids)]
        skip = self.spec.skip_special if skip_special is None else skip_special
        return TokenLoader(sources, self.dtype, batch_size, shuffle=shuffle, seed=seed, start=start, epoch=epoch,
                           out_dtype=dtype, skip_ids=self.special_ids if skip else (), drop_last=drop_last)

    def token_dataset(self, layer: int = -1, batch_size: int = 4096, **options: Any) -> Any:
        """:meth:`token_loader` as a ``torch.utils.data.IterableDataset`` of batches for a ``DataLoader`` (use
        ``batch_size=None`` there): each worker reads every ``num_workers``-th batch, so an epoch gives every row once
        however many workers (:class:`~layerwise.store.token_dataset.TokenDataset`)."""
        from .token_dataset import TokenDataset

        return TokenDataset(functools.partial(_loader, str(self.path)), layer, batch_size, **options)

    def verify(self) -> list[str]:
        """Every listed shard's sha256 against the manifest; the problems found (empty: intact)."""
        problems = []
        for e in self.entries:
            p = self.path / e["file"]
            if not p.is_file():
                problems.append(f"{e['file']} is missing")
            elif file_sha256(p) != e["sha256"]:
                problems.append(f"{e['file']} does not match its sha256 (its bytes changed)")
        return problems


def _loader(path: str, layer: int, batch_size: int, **options: Any) -> Any:
    """The token loader of the store at ``path`` (what each DataLoader worker opens for itself)."""
    return ActivationStore(path).token_loader(layer, batch_size, **options)


def open_activations(path: str | os.PathLike) -> ActivationStore:
    """Open a token-activation store (:class:`ActivationStore`)."""
    return ActivationStore(path)


__all__ = ["ActivationStore", "ActivationWriter", "FORMAT", "KINDS", "is_activation_store", "open_activations",
           "scale_name", "values_name"]
