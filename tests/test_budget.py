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


def test_a_name_in_the_lists_is_a_module_a_test_or_one_parametrisation():
    assert budget.names("tests/a.py::", "tests/a.py::test_x[1]")
    assert budget.names("tests/a.py::test_x", "tests/a.py::test_x") and budget.names("tests/a.py::test_x",
                                                                                      "tests/a.py::test_x[1]")
    assert not budget.names("tests/a.py::test_x", "tests/a.py::test_x_and_more")  # a name is not a prefix
    assert budget.names("tests/a.py::test_x[1]", "tests/a.py::test_x[1]")
    assert not budget.names("tests/a.py::test_x[1]", "tests/a.py::test_x[10]")


def test_every_test_allowed_past_the_limit_is_in_the_slow_tier_with_a_reason():
    assert all(why.strip() for why in budget.SLOW.values())
    for name in budget.EXEMPT:
        example = name + "test_example" if name.endswith("::") else name
        assert any(budget.names(slow, example) for slow in budget.SLOW), name


def test_a_slow_test_is_marked_and_a_name_that_matches_nothing_fails_a_whole_run_in_ci(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "conftest.py").write_text(
        "import sys\nsys.path.insert(0, %r)\nimport budget\n"
        "budget.SLOW = {'tests/test_x.py::test_long': 'why', 'tests/test_x.py::test_gone': 'why'}\n"
        "budget.EXEMPT = {}\n"
        "def pytest_configure(config):\n    config.pluginmanager.register(budget, 'layerwise-budget')\n"
        % str(Path(__file__).parent))
    (tmp_path / "tests" / "test_x.py").write_text("def test_quick():\n    pass\n\ndef test_long():\n    pass\n")
    env = {**os.environ, "LAYERWISE_TEST_DURATIONS": str(tmp_path), "LAYERWISE_CI": "1"}
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-o", "markers=slow: x"]
    quick = subprocess.run([*run, "-m", "not slow", "tests"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert quick.returncode == 0 and "1 passed, 1 deselected" in quick.stdout, quick.stdout[-2000:]
    whole = subprocess.run([*run, "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert whole.returncode == 1 and "'tests/test_x.py::test_gone' in tests/budget.py names no test" in whole.stdout
    assert "test_long" not in whole.stdout.split("time budget")[-1]


def _server_processes() -> set[str]:
    """``path::function`` of every test or fixture that starts a server process: it calls ``serving`` or
    ``cli_server`` (``tests/tiny.py``), or runs ``python -m layerwise.cli.main serve`` itself."""
    import ast

    root = Path(__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        if path.name == "tiny.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                called = isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and \
                    sub.func.id in ("serving", "cli_server")
                words = [e.value for e in sub.elts if isinstance(e, ast.Constant)] if isinstance(sub, ast.List) else []
                if called or ("layerwise.cli.main" in words and "serve" in words):
                    found.add(f"{path.relative_to(root.parent).as_posix()}::{node.name}")
    return found


def test_only_the_named_tests_start_a_server_process():
    """A server process costs seconds of imports; the tests that start one are named, each with why (tests/tiny.py
    SERVER_PROCESSES), and the others serve in a thread."""
    from tiny import SERVER_PROCESSES

    assert all(why.strip() for why in SERVER_PROCESSES.values())
    found = _server_processes()
    assert found - set(SERVER_PROCESSES) == set(), "serve these in a thread (tiny.serve_in_thread), or name them"
    assert set(SERVER_PROCESSES) - found == set(), "named but no longer starting a server: drop them from the list"
