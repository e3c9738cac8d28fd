"""CoNLL-2003 and CoNLL-U readers (one record per sentence) and CoNLL-2003 document context."""

from __future__ import annotations

from typing import IO, Iterator, Sequence

from ..errors import InputError
from .records import BadRecord, Item, Record, iter_lines

CONLL2003_COLUMNS = ("word", "pos", "chunk", "ner")
CONLLU_COLUMNS = ("id", "word", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")


def _sentences(fh: IO[bytes]) -> Iterator[tuple[int, list[tuple[int, str]] | BadRecord]]:
    """Blank-line separated blocks of ``(line number, line)``; a block with invalid UTF-8 is a BadRecord."""
    block: list[tuple[int, str]] = []
    bad: BadRecord | None = None
    for n, line in iter_lines(fh):
        if line is None:
            bad = bad or BadRecord(n, "invalid UTF-8")
            block.append((n, ""))
            continue
        if line.strip():
            block.append((n, line))
            continue
        if block:
            yield block[0][0], bad or block
        block, bad = [], None
    if block:
        yield block[0][0], bad or block


def read_conll2003(fh: IO[bytes], keep: Sequence[str]) -> Iterator[Item]:
    allowed = set(CONLL2003_COLUMNS[1:]) | {"doc"}
    unknown = [k for k in keep if k not in allowed]
    if unknown:
        raise InputError(f"--keep {unknown[0]!r} is not a CoNLL-2003 column. Valid columns are: pos, chunk, ner, doc")
    doc = 0
    seen_docstart = False
    for start, block in _sentences(fh):
        if isinstance(block, BadRecord):
            yield block
            continue
        if block[0][1].startswith("-DOCSTART-"):
            doc += 1 if seen_docstart else 0
            seen_docstart = True
            block = block[1:]
            if not block:
                continue
            start = block[0][0]
        rows = [line.split() for _, line in block]
        width = len(rows[0])
        odd = next(((n, r) for (n, _), r in zip(block, rows) if len(r) != width), None)
        if odd is not None:
            yield BadRecord(odd[0], f"line has {len(odd[1])} columns, the sentence's first line has {width}")
            continue
        if any(r[0].startswith("-DOCSTART-") for r in rows):
            n = next(n for (n, _), r in zip(block, rows) if r[0].startswith("-DOCSTART-"))
            yield BadRecord(n, "-DOCSTART- inside a sentence (a blank line must separate it)")
            continue
        cols = list(zip(*rows))
        fields: dict[str, object] = {}
        for k in keep:
            if k == "doc":
                fields["doc"] = doc
                continue
            idx = CONLL2003_COLUMNS.index(k) if width == 4 else {"pos": 1, "chunk": width - 2, "ner": width - 1}[k]
            if idx >= width or width < 2:
                yield BadRecord(start, f"sentence has {width} columns, no {k!r} column")
                break
            fields[k] = list(cols[idx])
        else:
            words = list(cols[0])
            yield Record(start, " ".join(words), words=words, fields=fields)


def with_document_context(items: Iterator[Item], max_words: int = 250) -> Iterator[Item]:
    """Give each CoNLL-2003 sentence its neighbours from the same document as context (BERT paper, section 5.3).

    Sentences of one document (same ``doc`` field) are buffered; each gets the nearest previous and next sentences,
    alternately, while the total stays within ``max_words`` words (so the window fits the model). Bad records pass
    through in order.
    """
    doc: list[Item] = []
    current = None

    def flush() -> Iterator[Item]:
        good = [r for r in doc if isinstance(r, Record)]
        where = {id(r): i for i, r in enumerate(good)}
        words: list[list[str]] = []  # words[i]: the words of good[i]
        for r in good:
            words.append(r.words if r.words is not None else r.text.split())
        for item in doc:
            if isinstance(item, Record):
                i = where[id(item)]
                left: list[str] = []
                right: list[str] = []
                total, lo, hi = len(words[i]), i - 1, i + 1
                while lo >= 0 or hi < len(good):
                    grew = False
                    if lo >= 0 and total + len(words[lo]) <= max_words:
                        left = words[lo] + left
                        total += len(words[lo])
                        lo -= 1
                        grew = True
                    if hi < len(good) and total + len(words[hi]) <= max_words:
                        right = right + words[hi]
                        total += len(words[hi])
                        hi += 1
                        grew = True
                    if not grew:
                        break
                item.context = (left, right)
            yield item

    for item in items:
        d = item.fields.get("doc") if isinstance(item, Record) else current
        if d != current and doc:
            yield from flush()
            doc = []
        current = d
        doc.append(item)
    if doc:
        yield from flush()


def read_conllu(fh: IO[bytes], keep: Sequence[str]) -> Iterator[Item]:
    allowed = set(CONLLU_COLUMNS[2:]) | {"sent_id", "sent_text"}
    unknown = [k for k in keep if k not in allowed]
    if unknown:
        raise InputError(
            f"--keep {unknown[0]!r} is not a CoNLL-U column. Valid columns are: {', '.join(sorted(allowed))}"
        )
    for start, block in _sentences(fh):
        if isinstance(block, BadRecord):
            yield block
            continue
        meta: dict[str, str] = {}
        rows: list[list[str]] = []
        bad = None
        for n, line in block:
            if line.startswith("#"):
                key, _, value = line[1:].partition("=")
                meta[key.strip()] = value.strip()
                continue
            cells = line.split("\t")
            if len(cells) != 10:
                bad = BadRecord(n, f"CoNLL-U word line has {len(cells)} tab-separated columns, expected 10")
                break
            if "-" in cells[0] or "." in cells[0]:
                continue  # multiword token range or empty node: not a word of the tree
            rows.append(cells)
        if bad is not None:
            yield bad
            continue
        if not rows:
            yield BadRecord(start, "sentence without word lines")
            continue
        first = next(n for n, line in block if not line.startswith("#"))
        cols = dict(zip(CONLLU_COLUMNS, zip(*rows)))
        fields: dict[str, object] = {}
        for k in keep:
            if k == "sent_id":
                fields[k] = meta.get("sent_id")
            elif k == "sent_text":
                fields[k] = meta.get("text")
            elif k == "head":
                fields[k] = [int(h) if h.isdigit() else -1 for h in cols["head"]]
            else:
                fields[k] = list(cols[k])
        words = list(cols["word"])
        yield Record(first, " ".join(words), words=words, fields=fields)
