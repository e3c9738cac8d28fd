"""A run's input checked as it is read: unchanged before each shard is written, and at the end the bytes the reader
took in are the bytes whose sha256 the store records.

The store's manifest records the input's sha256, taken before the run (a resume compares it before any model work).
:class:`InputCheck` makes that the sha256 of what was read (see :mod:`layerwise.corpus.watch`):

* before each shard is written, the input's files must still have the size, modification time and inode they had
  before they were hashed; else the run stops with :class:`~layerwise.ExtractError` saying what changed, and the
  shards already finished (each read before the change) stay listed for a resume on the right input;
* at the end of a run that read the whole input, the sha256 of the bytes read must be the recorded one (a change
  after the reading does not matter); else (say a rewrite that kept size and modification time) the shards this run
  wrote are unlisted and removed, and the run stops the same way. An input not hashed as it is read (parquet) is
  checked by its files again.

stdin has no file to watch: it is hashed as it streams (its own check, in :mod:`layerwise.extraction.engine`).
"""

from __future__ import annotations

from ..corpus.sources import Source
from ..corpus.watch import InputWatch, ReadDigest
from ..errors import ExtractError
from ..store import StoreWriter


def _records(n: int) -> str:
    return f"{n:,} record{'' if n == 1 else 's'}"


class InputCheck:
    """The checks of one run's input (a file, several files or a parquet input; not stdin or a table).

    Build it before the input is hashed (:meth:`watch`), then call :meth:`hashed` with the recorded sha256,
    :meth:`before_shard` before each shard is written and :meth:`at_end` once the input is read.
    """

    def __init__(self, source: Source, watch: InputWatch):
        self.source, self._watch = source, watch
        self.digest: ReadDigest | None = ReadDigest() if source.hashed_as_read else None
        self.sha256: str | None = None
        self._first_shard = 0  # the first shard this run writes (its position in the writer's list)

    @classmethod
    def watch(cls, source: Source) -> "InputCheck | None":
        """Start watching ``source``'s files (before they are hashed); ``None`` for stdin and tables."""
        if source.is_stdin or not source.files():
            return None
        return cls(source, InputWatch(source.files()))

    def hashed(self, sha256: str | None) -> None:
        """The sha256 recorded for the input (taken after :meth:`watch`); a change while it was hashed stops here.

        Raises:
            ExtractError: the input changed while it was hashed (nothing was written).
        """
        self.sha256 = sha256
        changes = self._watch.changes()
        if changes:
            raise ExtractError(f"the input {self.source.name} changed while it was hashed, before the run began: "
                               f"{'; '.join(changes)}. Rerun once nothing writes to it")

    def started(self, writer: StoreWriter) -> None:
        """The run starts writing after the shards ``writer`` already lists."""
        self._first_shard = len(writer.shards)

    def before_shard(self, writer: StoreWriter) -> None:
        """Check the input before the next shard of ``writer`` is written.

        Raises:
            ExtractError: the input changed (what changed, what the store keeps, what to do).
        """
        changes = self._watch.changes()
        if changes:
            raise ExtractError(
                f"the input {self.source.name} changed during the run: {'; '.join(changes)}. {self._kept(writer)} "
                f"(the records after input line {writer.resume_line} were not written). {self._todo()}"
            )

    def at_end(self, writer: StoreWriter, skipped: int) -> None:
        """Check the input once the run has read it: the bytes read are the bytes hashed (files whose bytes are not
        hashed as read, or not read to the end: unchanged).

        Raises:
            ExtractError: the input changed; when only the hash of what was read tells, this run's shards are unlisted
                and removed first (``skipped``: the manifest's count of skipped records).
        """
        if self.digest is None or not self.digest.complete or self.sha256 is None:
            self.before_shard(writer)  # no hash of what was read (parquet, or not read to its end): its files
            return
        got = self.digest.hexdigest()  # what was read, all of it: a change after the reading does not matter
        if got == self.sha256:
            return
        dropped = writer.unlist(self._first_shard, skipped)
        raise ExtractError(
            f"the input {self.source.name} changed during the run: the bytes read hash to {got[:16]}..., not to the "
            f"sha256 {self.sha256[:16]}... it had when the run started (its size and modification time are as they "
            f"were, so when it changed is unknown). The {_records(dropped)} this run computed are dropped. "
            f"{self._kept(writer)}. {self._todo()}"
        )

    def _kept(self, writer: StoreWriter) -> str:
        return (f"The store {str(writer.path)!r} keeps the {_records(writer.done_records)} of its finished shards, "
                f"read from the input the run started with (sha256 {(self.sha256 or '?')[:16]}...)")

    @staticmethod
    def _todo() -> str:
        return ("Put that input back and rerun the same command to resume, or pass --overwrite to extract the changed "
                "input from the start (or give another output directory)")


__all__ = ["InputCheck"]
