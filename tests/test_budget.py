"""The suite's time budget (``tests/budget.py``): a test past the limit is named unless exempt with a reason, the
suite's wall time is checked only for a whole run, and in CI a limit passed fails the run (a real pytest run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import budget


def test_a_test_over_the_limit_is_named_unless_exempt():
    exempt = next(iter(budget.EXEMPT))
    lines = budget.over_budget({"tests/a.py::fast": 1.0, "tests/a.py::slow": budget.TEST_LIMIT + 1,
                                exempt: budget.TEST_LIMIT * 3}, wall=60.0, whole_suite=True)
    assert len(lines) == 1 and lines[0].startswith("tests/a.py::slow took 91.0 s (the limit is 90 s)")
    assert all(why.strip() for why in budget.EXEMPT.values())  # each exemption says why


def test_the_suite_limit_applies_to_a_whole_run_only():
    assert budget.over_budget({}, wall=budget.SUITE_LIMIT + 60, whole_suite=False) == []
    (line,) = budget.over_budget({}, wall=budget.SUITE_LIMIT + 60, whole_suite=True)
    assert line.startswith("the suite took 26.0 min (the limit is 25 min)")


def test_in_ci_a_test_over_the_limit_fails_the_run_and_durations_are_written(tmp_path, monkeypatch):
    (tmp_path / "conftest.py").write_text(
        "import sys\nsys.path.insert(0, %r)\nimport budget\nbudget.TEST_LIMIT = 0.2\n"
        "def pytest_configure(config):\n    config.pluginmanager.register(budget, 'layerwise-budget')\n"
        % str(Path(__file__).parent))
    (tmp_path / "test_x.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                        "def test_long():\n    time.sleep(0.5)\n")
    env = {**os.environ, "LAYERWISE_TEST_DURATIONS": str(tmp_path)}
    for ci, code in (("1", 1), ("", 0)):
        env["LAYERWISE_CI"] = ci
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                               str(tmp_path / "test_x.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == code, done.stdout[-2000:]
        said = "error" if ci else "warning"
        assert f"\n{said}: time budget: test_x.py::test_long took 0." in done.stdout
        assert "(the limit is 0.2 s)" in done.stdout and "test_quick" not in done.stdout
        written = json.loads((tmp_path / "test-durations.json").read_text())
        assert list(written["tests"])[0] == "test_x.py::test_long" and written["wall_seconds"] > 0
