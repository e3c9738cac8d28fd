"""One part of a store of parts (:mod:`layerwise.store.parts`), written whole: ``STORE/part-NNNNN``.

A part is written as a complete store beside its place and renamed into it (:func:`write_part`), so a part is absent
or complete, whatever stops its writer; a part written twice (a retried task) is the same part, and the rename keeps
one. :func:`finished_parts` says which parts of a run are already on disk, complete and made with the run's options,
so a rerun of a killed run skips them. (This sits beside :mod:`layerwise.store.parts`, not in it: it writes through
:class:`~layerwise.store.writer.StoreWriter`, whose resume checks read stores of parts.)
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from ..errors import StoreError
from .layout import MANIFEST
from .parts import part_name
from .writer import StoreWriter


def part_path(output: str | os.PathLike, part: int) -> Path:
    """Where part ``part`` of a store of parts at ``output`` is written: ``OUTPUT/part-NNNNN``."""
    return Path(output) / part_name(part)


def write_part(path: Path, header: dict[str, Any], shard: Any, errors: list[tuple[int, str]],
               facts: dict[str, Any] | None = None) -> None:
    """One part store at ``path``, written beside it and renamed into place (a part is absent or complete); its
    manifest records its split's ``facts`` (``split``: lines, sha256 of its bytes, each stage's seconds).

    Raises:
        StoreError: ``path`` holds files that are not a layerwise part store (they are left alone).
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    t0 = time.perf_counter()
    with StoreWriter(tmp, header) as writer:  # its lock goes (and its file) before the rename
        writer.open()
        if shard is not None:
            tensors, meta, tokens = shard
            writer.write_shard(tensors, meta, tokens=tokens)
        for line, reason in errors:
            writer.log_error(line, reason)
        writer.manifest["split"] = {**(facts or {}), "write_seconds": time.perf_counter() - t0}
        writer.write_manifest("complete", len(errors))
    try:
        os.replace(tmp, path)  # an empty directory left by an interrupted run is replaced
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temporary directory
        if not (path / MANIFEST).exists():
            raise StoreError(f"{str(path)!r} holds files that are not a layerwise part store: move them away and "
                             f"rerun (layerwise never deletes files it did not write)") from None
        # else: a retried write found the same part already there


def finished_parts(output: str | os.PathLike, header: dict[str, Any], parts: Sequence[dict[str, Any]],
                   overwrite: bool) -> set[int]:
    """The parts (their indexes) already complete on disk with this ``header`` (and each its part's ``parts``
    entry); a part made with other options is refused unless ``overwrite`` (then it is redone).

    Raises:
        StoreError: a part made with other options (naming the differences), without ``overwrite``.
    """
    done = set()
    for p, part in enumerate(parts):
        path = part_path(output, p)
        if not (path / MANIFEST).exists():
            continue
        with StoreWriter(path, {**header, "part": part}) as writer:
            state = writer.open(overwrite=overwrite)
        if state == "complete":
            done.add(p)
    return done


__all__ = ["finished_parts", "part_path", "write_part"]
