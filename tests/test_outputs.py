"""One rule for what layerwise writes (layerwise.outputs.OwnedOutput): nothing without the marker is replaced (even
with overwrite), an earlier output of layerwise only with overwrite, and the output is placed whole (a failed
write leaves the earlier one as it was, and no temporary behind). The writers that use it (store export, heads,
probe, export-model, the explorer's page) are tested with their own outputs in their own test files; here the
rule itself, and that those writers hold no copy of it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from layerwise.errors import LayerwiseError
from layerwise.outputs import OwnedOutput

SRC = Path(__file__).resolve().parents[1] / "src" / "layerwise"


def _owned(path: Path) -> bool:
    try:
        return json.loads((path / "m.json").read_text())["format"] == "mine"
    except (OSError, ValueError, KeyError):
        return False


def _dir(path: Path) -> OwnedOutput:
    return OwnedOutput(path, "directory", "test output", owned=_owned, marker="m.json",
                       own_entries=lambda d: [n for n in ("m.json", "a", "sub", "c") if (d / n).exists()])


def _files(entries: dict[str, str]):
    def write(staged: Path) -> None:
        for name, text in entries.items():
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).write_text(text)
    return write


MARK = json.dumps({"format": "mine"})


def test_a_directory_output_new_then_replaced_entry_by_entry(tmp_path):
    out = _dir(tmp_path / "d")
    out.write(_files({"m.json": MARK, "a": "1", "sub/b": "2"}), overwrite=False)
    assert sorted(os.listdir(tmp_path / "d")) == ["a", "m.json", "sub"]
    (tmp_path / "d" / "notes.txt").write_text("the user's")
    with pytest.raises(LayerwiseError, match=re.escape("holds an earlier test output; pass --overwrite")):
        out.write(_files({"m.json": MARK}), overwrite=False)
    out.write(_files({"m.json": MARK, "c": "3"}), overwrite=True)
    # the earlier output's own entries it no longer has are gone, the user's file stays, no temporary is left
    assert sorted(os.listdir(tmp_path / "d")) == ["c", "m.json", "notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["d"]


def test_nothing_without_the_marker_is_replaced(tmp_path):
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "a").write_text("keep")
    with pytest.raises(LayerwiseError, match=r"exists and is not a test output \(it has no m.json\); layerwise never "
                                             r"replaces what it did not write, even with --overwrite"):
        _dir(tmp_path / "theirs").write(_files({"m.json": MARK}), overwrite=True)
    (tmp_path / "file").write_text("keep")
    with pytest.raises(LayerwiseError, match="is a file; give a directory for the test output"):
        _dir(tmp_path / "file").write(_files({"m.json": MARK}), overwrite=True)
    assert (tmp_path / "theirs" / "a").read_text() == "keep" and (tmp_path / "file").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["file", "theirs"]
    (tmp_path / "empty").mkdir()  # an empty directory is free
    _dir(tmp_path / "empty").write(_files({"m.json": MARK}), overwrite=False)
    assert os.listdir(tmp_path / "empty") == ["m.json"]


def test_a_file_output_is_replaced_in_one_rename_and_a_failure_changes_nothing(tmp_path):
    page = OwnedOutput(tmp_path / "p.txt", "file", "test page", owned=lambda p: p.read_text().startswith("X"),
                       marker="X first")
    page.write(lambda staged: staged.write_text("X1"), overwrite=False)
    inode = (tmp_path / "p.txt").stat().st_ino

    def fails(staged: Path) -> None:
        staged.write_text("X half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        page.write(fails, overwrite=True)
    assert (tmp_path / "p.txt").read_text() == "X1" and os.listdir(tmp_path) == ["p.txt"]
    page.write(lambda staged: staged.write_text("X2"), overwrite=True)
    assert (tmp_path / "p.txt").read_text() == "X2" and (tmp_path / "p.txt").stat().st_ino != inode
    (tmp_path / "d").mkdir()
    with pytest.raises(LayerwiseError, match="is a directory; give a file name for the test page"):
        OwnedOutput(tmp_path / "d", "file", "test page", owned=lambda p: True, marker="-").check(True)
    with pytest.raises(ValueError, match="unknown output kind 'dir'. Valid kinds are: file, directory, files"):
        OwnedOutput(tmp_path / "d", "dir", "x", owned=lambda p: True, marker="-")  # type: ignore[arg-type]


def test_named_files_in_a_shared_directory(tmp_path):
    def listed(d: Path):
        try:
            return set(json.loads((d / "r.json").read_text())["files"])
        except (OSError, ValueError, KeyError):
            return None

    out = OwnedOutput(tmp_path, "files", "test results", owned=lambda d: listed(d) is not None, marker="r.json",
                      names=("r.csv", "r.json"), marker_file="r.json", listed=listed,
                      maker="the tester")
    (tmp_path / "r.csv").write_text("the user's")
    (tmp_path / "other.txt").write_text("the user's")
    with pytest.raises(LayerwiseError, match=re.escape("holds r.csv, which the tester did not write (it has no "
                                                       "r.json); layerwise never replaces files it did not write")):
        out.check(True)
    (tmp_path / "r.csv").unlink()
    out.write(_files({"r.json": json.dumps({"files": ["r.json", "r.csv"]}), "r.csv": "1"}), overwrite=False)
    assert sorted(os.listdir(tmp_path)) == ["other.txt", "r.csv", "r.json"]
    with pytest.raises(LayerwiseError, match=re.escape("holds an earlier test results (r.csv, r.json); pass")):
        out.check(False)


def test_the_writers_hold_no_copy_of_the_rule():
    """The five writers place their outputs through OwnedOutput: no temp-then-replace of their own is left."""
    for module in ("store/export.py", "heads/classifier.py", "heads/train.py", "probe/report.py",
                   "explore/export.py", "cut/export.py"):
        text = (SRC / module).read_text()
        assert "OwnedOutput" in text or "owned_model_dir" in text, module
        assert "os.replace(" not in text, module
