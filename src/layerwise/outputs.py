"""What layerwise writes for the user, said once: an output is recognised by its marker, replaced only when it is
layerwise's own and ``overwrite`` is given, and put in place whole.

:class:`OwnedOutput` is one output path and the rule every writer of one follows (store export, a head's model
directory, a probe's results, an exported model, an explorer page):

* **the marker**: ``owned(path)`` says whether what is at the path was written by layerwise as this kind of output
  (a manifest, a format field, a metadata key: each writer knows its own);
* **the overwrite rule** (:meth:`OwnedOutput.check`, before any work): an absent path (or an empty directory) is
  free; something without the marker is refused, even with ``overwrite``; an earlier output of layerwise is replaced
  only with ``overwrite``; a file where a directory is wanted (or the reverse) is refused;
* **atomic placement** (:meth:`OwnedOutput.write`): the output is written under a fresh temporary name beside its
  place (``.NAME.tmp-PID-RANDOM``, layerwise's own name, removed on failure) and renamed in. A file is replaced in
  one rename. A directory that is new (or empty) is renamed in whole; into an earlier output each entry of the new
  one replaces its namesake (a replaced directory is moved aside and removed once the new one is in), the earlier
  output's own entries that the new one lacks are removed, and nothing else in the directory is touched. With
  ``kind="files"`` the output is a set of named files inside a directory that may hold other things (a probe's
  results): only those names are checked and replaced, the marker file first.

It imports nothing above the standard library and the error family, so the store package uses it too.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

from .errors import LayerwiseError

OutputKind = Literal["file", "directory", "files"]
OUTPUT_KINDS = ("file", "directory", "files")


@dataclass(frozen=True)
class OwnedOutput:
    """One output layerwise writes (see the module docstring).

    Attributes:
        path: the file, or the directory.
        kind: ``file``, ``directory`` (the directory is the output), or ``files`` (the files ``names`` inside the
            directory ``path`` are the output).
        what: what the output is, for messages: ``"layerwise hdf5 export"``, ``"layerwise model"``.
        owned: the marker check: whether what is at ``path`` is an earlier output of this kind.
        marker: how the marker looks, for messages (``"a manifest.json of a layerwise export"``).
        own_entries: the entries of an earlier directory output that it wrote (top-level names), which a new one
            replaces or removes; default: every entry of the new output only.
        names: ``kind="files"``: the output's file names (in the order messages list them). marker_file: the one
            of them that holds the marker, put in place first.
        listed: ``kind="files"``: the names the marker file of ``path`` lists as its own (``None``: no marker);
            ``owned`` is then whether every present name is listed. maker: who writes it, for messages
            (``"layerwise probe"``).
        error: the error raised (a :class:`~layerwise.LayerwiseError` subclass of the writer's package).
    """

    path: Path
    kind: OutputKind
    what: str
    owned: Callable[[Path], bool]
    marker: str
    own_entries: Callable[[Path], Sequence[str]] | None = None
    names: tuple[str, ...] = ()
    marker_file: str = ""
    listed: Callable[[Path], set[str] | None] | None = None
    maker: str = "layerwise"
    error: type[LayerwiseError] = field(default=LayerwiseError)

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise LayerwiseError(f"unknown output kind {self.kind!r}. Valid kinds are: {', '.join(OUTPUT_KINDS)}")
        object.__setattr__(self, "path", Path(self.path))

    # ---- the rule ----------------------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"output {str(self.path)!r}"

    def present(self) -> bool:
        """Whether something is in the way: a path that exists (not an empty directory; for ``files``, one of the
        names)."""
        p = self.path
        if self.kind == "files":
            return p.is_dir() and any((p / n).exists() or (p / n).is_symlink() for n in self.names)
        if not p.exists() and not p.is_symlink():
            return False
        return not (self.kind == "directory" and p.is_dir() and not p.is_symlink() and not any(p.iterdir()))

    def check(self, overwrite: bool) -> None:
        """The overwrite rule, before any work (see the module docstring).

        Raises:
            LayerwiseError (``error``): a file where a directory is wanted or the reverse, something layerwise did
                not write (even with ``overwrite``), or an earlier output of layerwise without ``overwrite``.
        """
        p, where = self.path, self._where()
        if self.kind == "file" and p.is_dir():
            raise self.error(f"{where} is a directory; give a file name for the {self.what}")
        if self.kind != "file" and p.exists() and not p.is_dir():
            raise self.error(f"{where} is a file; give a directory for the {self.what}")
        if not self.present():
            return
        if self.kind == "files":
            self._check_files(overwrite)
            return
        if not self.owned(p):
            raise self.error(
                f"{where} exists and is not a {self.what} (it has no {self.marker}); layerwise never replaces what "
                f"it did not write, even with --overwrite: choose another output path (-o), or move it away yourself"
            )
        if not overwrite:
            raise self.error(f"{where} holds an earlier {self.what}; pass --overwrite (overwrite=True) to replace it, "
                             f"or choose another output path (-o)")

    def _check_files(self, overwrite: bool) -> None:
        p, where = self.path, self._where()
        present = [n for n in self.names if (p / n).exists() or (p / n).is_symlink()]
        listed = self.listed(p) if self.listed is not None else (set(self.names) if self.owned(p) else None)
        foreign = [n for n in present if listed is None or n not in listed]
        if foreign:
            why = f"its {self.marker_file} does not list them" if listed is not None else f"it has no {self.marker}"
            raise self.error(
                f"{where} holds {_names(foreign)}, which {self.maker} did not write ({why}); layerwise never replaces "
                f"files it did not write, even with --overwrite: choose another directory (-o), or move "
                f"{'that file' if len(foreign) == 1 else 'those files'} away yourself"
            )
        if not overwrite:
            raise self.error(f"{where} holds an earlier {self.what} ({_names(present)}); pass --overwrite "
                             f"(overwrite=True) to replace it, or choose another directory (-o)")

    # ---- atomic placement --------------------------------------------------------------------------------------
    def staging(self) -> Path:
        """A fresh temporary name beside the output (not created: the writer creates it, so the user's umask sets
        its permissions)."""
        base = self.path if self.kind != "files" else self.path / "layerwise"
        base.parent.mkdir(parents=True, exist_ok=True)
        return base.with_name(f".{base.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def write(self, write: Callable[[Path], object], *, overwrite: bool) -> Path:
        """Check the rule, write the output with ``write(staged)`` under a temporary name (a file, or a directory
        ``write`` fills), check the rule again (the path may have changed meanwhile) and put it in place. Returns
        the path. On any failure the temporary output is removed and the earlier output is as it was."""
        self.check(overwrite)
        staged = self.staging()
        try:
            if self.kind != "file":
                staged.mkdir()
            write(staged)
            self.place(staged, overwrite=overwrite)
        finally:
            _remove(staged)
        return self.path

    def place(self, staged: Path, *, overwrite: bool) -> None:
        """Put the written ``staged`` output in place (the rule checked again first); ``staged`` is consumed."""
        self.check(overwrite)
        p = self.path
        if self.kind == "file":
            os.replace(staged, p)
            return
        if self.kind == "directory" and not self.present():
            if p.is_dir():
                p.rmdir()  # empty: the rename puts the whole new output in its place
            os.replace(staged, p)
            return
        p.mkdir(parents=True, exist_ok=True)
        written = {e.name for e in staged.iterdir()}
        if self.kind == "files":  # the marker first: an output interrupted here is still recognised as layerwise's
            new = tuple(sorted((n for n in self.names if n in written), key=lambda n: n != self.marker_file))
        else:
            new = tuple(sorted(written))
        old = tuple(self.own_entries(p)) if self.own_entries is not None and self.kind == "directory" else ()
        for name in new:
            _replace(staged / name, p / name)
        for name in old:
            if name not in new:
                _remove(p / name)
        _remove(staged)  # emptied


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def _remove(path: Path) -> None:
    """Remove a file or directory of layerwise's own (nothing when absent)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _replace(new: Path, old: Path) -> None:
    """Put ``new`` at ``old``: a file in one rename; a directory by moving the old one aside first (put back if the
    rename fails) and removing it once the new one is in."""
    if not (old.is_dir() and not old.is_symlink()):
        if new.is_dir():
            old.unlink(missing_ok=True)
        os.replace(new, old)
        return
    aside = old.with_name(f".{old.name}.replaced-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(old, aside)
    try:
        os.replace(new, old)
    except OSError:
        os.replace(aside, old)
        raise
    shutil.rmtree(aside, ignore_errors=True)


__all__ = ["OUTPUT_KINDS", "OutputKind", "OwnedOutput"]
