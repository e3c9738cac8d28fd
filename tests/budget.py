"""The test suite's time budget, a pytest plugin (registered by ``conftest.py``).

Every test's duration (setup, call and teardown) goes to ``test-durations.json`` in the directory of
``$LAYERWISE_TEST_DURATIONS`` (default: the repository root; the file is git-ignored), longest first, with the
session's wall time. Two limits, checked at the end of the session:

- a test may take at most :data:`TEST_LIMIT` seconds unless :data:`EXEMPT` names it with why it needs more;
- the whole suite (a run of ``tests/`` as ``./dev test`` runs it) may take at most :data:`SUITE_LIMIT` seconds on
  the 2-core CI machine.

In CI (``$LAYERWISE_CI``) a limit passed fails the run, naming the tests; elsewhere (a laptop under other load) it is
said as a warning. The per-test timeout (``timeout`` in ``pyproject.toml``) still ends a test that hangs.

The slow tier is the ``slow`` marker (``-m "not slow"`` is the quick loop); the tests allowed past the limit are
listed here, each with why its time is its point.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TEST_LIMIT = 90.0  # seconds a test may take (setup + call + teardown)
SUITE_LIMIT = 25 * 60.0  # seconds the whole suite may take

EXEMPT = {  # node id prefix -> why the test needs more than TEST_LIMIT under load
    "tests/docs/test_examples.py::test_notebook_runs[04_ner_all_layers]":
        "the NER notebook's whole layer study (13 probes on 600 sentences) is what it shows; 50-55 s quiet",
    "tests/extraction/test_ray.py::":
        "real Ray clusters started, stalled, killed and resumed; 9-40 s each quiet, their time is the cluster's",
    "tests/extraction/test_kill.py::":
        "real extraction processes interrupted and resumed; up to 29 s quiet, 241 s beside another test run",
    "tests/model/test_openvino.py::test_int8_full":
        "int8-full calibrates on the default model's activations; 16-29 s quiet, 79-146 s under load",
}

_durations: dict[str, float] = {}
_started = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def over_budget(durations: dict[str, float], wall: float, whole_suite: bool) -> list[str]:
    """What passed a limit: one line per test over :data:`TEST_LIMIT` that :data:`EXEMPT` does not name, and one
    for the suite's ``wall`` time over :data:`SUITE_LIMIT` (only when ``whole_suite``)."""
    lines = [f"{nodeid} took {seconds:.1f} s (the limit is {TEST_LIMIT:g} s): make it cheaper, or name it in "
             f"tests/budget.py EXEMPT with why it needs the time"
             for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])
             if seconds > TEST_LIMIT and not any(nodeid.startswith(prefix) for prefix in EXEMPT)]
    if whole_suite and wall > SUITE_LIMIT:
        lines.append(f"the suite took {wall / 60:.1f} min (the limit is {SUITE_LIMIT / 60:.0f} min); "
                     f"test-durations.json lists where the time went")
    return lines


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.option.collectonly or not _durations:
        return
    wall = time.monotonic() - _started
    root = Path(os.environ.get("LAYERWISE_TEST_DURATIONS") or session.config.rootpath)
    ordered = dict(sorted(((k, round(v, 2)) for k, v in _durations.items()), key=lambda kv: -kv[1]))
    try:
        (root / "test-durations.json").write_text(json.dumps({"wall_seconds": round(wall, 1), "tests": ordered},
                                                             indent=1) + "\n", encoding="utf-8")
    except OSError:
        pass
    whole = [str(a) for a in session.config.args] in ([], ["tests"], [str(session.config.rootpath / "tests")])
    problems = over_budget(_durations, wall, whole)
    if not problems:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    ci = bool(os.environ.get("LAYERWISE_CI"))
    if reporter is not None:
        reporter.write("\n")  # after the progress line
    for line in problems:
        text = f"{'error' if ci else 'warning'}: time budget: {line}"
        if reporter is not None:
            reporter.write_line(text, red=ci, yellow=not ci)
    if ci and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
