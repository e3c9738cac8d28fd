"""The test suite's time budget, a pytest plugin (registered by ``conftest.py``).

Every test's duration (setup, call and teardown) goes to ``test-durations.json`` in the directory of
``$LAYERWISE_TEST_DURATIONS`` (default: the repository root; the file is git-ignored), longest first, with the
session's wall time. Two limits, checked at the end of the session:

- a test may take at most :data:`TEST_LIMIT` seconds unless :data:`EXEMPT` names it with why it needs more;
- the whole suite (a run of ``tests/`` as ``./dev test`` runs it) may take at most :data:`SUITE_LIMIT` seconds on
  the 2-core CI machine.

In CI (``$LAYERWISE_CI``) a limit passed fails the run, naming the tests; elsewhere (a laptop under other load) it is
said as a warning. The per-test timeout (``timeout`` in ``pyproject.toml``) still ends a test that hangs.

Tiers: :data:`SLOW` names every slow test in one place, each with why its time is its point; collection marks them
``slow``, so ``-m "not slow"`` is the quick loop (under 5 minutes on 2 cores) and CI runs everything. A name in
:data:`SLOW` or :data:`EXEMPT` that matches no collected test fails a whole-suite run in CI, so the lists cannot rot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

TEST_LIMIT = 90.0  # seconds a test may take (setup + call + teardown)
SUITE_LIMIT = 25 * 60.0  # seconds the whole suite may take

EXEMPT = {  # test name (see names()) -> why the test needs more than TEST_LIMIT under load
    "tests/docs/test_examples.py::test_notebook_runs[04_ner_all_layers]":
        "the NER notebook's whole layer study (13 probes on 600 sentences) is what it shows; 50-55 s quiet",
    "tests/extraction/test_ray.py::":
        "real Ray clusters started, stalled, killed and resumed; 9-40 s each quiet, their time is the cluster's",
    "tests/extraction/test_kill.py::":
        "real extraction processes interrupted and resumed; up to 29 s quiet, 241 s beside another test run",
    "tests/model/test_openvino.py::test_int8_full_quantizes_activations_and_states_its_fidelity":
        "int8-full calibrates on the default model's activations; 16-29 s quiet, 79-146 s under load",
}

# test name (see names()) -> why the test is in the slow tier (its time in CI, on 2 cores: test-durations.json)
_RAY = "starts a real Ray cluster (4-10 s on 2 cores) and runs the extraction on its workers"
_CLI = "runs the real command in a child process (Python, torch and the model load: 3-5 s) and watches it"
_SERVER = "starts a real `layerwise serve` subprocess and drives it over HTTP"
_DEFAULT = "computes on the embedded default model (all-MiniLM-L6-v2), whose weights are the point"
_NOTEBOOK = "runs a documentation notebook end to end on the default model, as a reader would"
SLOW = {
    # runtimes: conversion, calibration and timing on real weights
    "tests/model/test_openvino.py::test_int8_full_quantizes_activations_and_states_its_fidelity":
        "calibrates int8 on the default model's activations and measures what it changed",
    "tests/model/test_openvino.py::test_int8_full_keeps_the_measured_most_sensitive_products_in_float":
        "measures each product's sensitivity on the default model",
    "tests/model/test_openvino.py::test_int8_weights_keep_the_layers": "quantizes the default model's weights",
    "tests/model/test_openvino.py::test_reduced_precision_measures_its_fidelity_once_and_says_when_it_misses":
        "measures bf16/fp16 fidelity on the default model",
    "tests/model/test_openvino.py::test_auto_bfloat16_races_pytorch_and_openvino_bf16":
        "races PyTorch against OpenVINO bf16 on the default model",
    "tests/model/test_tensorflow.py::": "imports TensorFlow (about 10 s) and converts models to Keras",
    "tests/model/test_shared_cache.py::test_three_processes_share_one_cache_with_a_small_limit":
        "three processes export into one size-limited cache",
    "tests/model/test_offload.py::test_background_export_and_conversion_run_in_a_child": _CLI,
    "tests/model/test_decoders.py::test_loading_a_causal_lm_checkpoint_prints_no_load_report": _CLI,
    "tests/model/test_depth.py::test_peak_memory_follows_the_layer_asked_for": "measures peak memory per depth",
    "tests/model/test_depth.py::test_streamed_extract_killed_and_resumed_equals_in_memory": _CLI,
    "tests/model/test_capture.py::test_early_exit_default_model_counts": _DEFAULT,
    "tests/test_invariance.py::test_default_model_invariance": _DEFAULT,
    "tests/test_invariance.py::test_matches_sentence_transformers_mean_pooling": "imports sentence-transformers",
    "tests/encoding/test_long.py::test_2000_token_text_default_model": _DEFAULT,
    # extraction processes: clusters, kills, resumes, locks
    "tests/extraction/test_ray.py::": _RAY,
    "tests/extraction/test_kill.py::": "interrupts real extraction processes at every stage and resumes them",
    "tests/extraction/test_sharding.py::test_a_part_resumes_alone_and_the_cli_merges": _CLI,
    "tests/extraction/test_input_identity.py::"
    "test_a_rewrite_that_keeps_size_and_mtime_is_caught_by_the_hash_of_what_was_read":
        _CLI,
    "tests/store/test_store_lock.py::test_a_second_extract_process_is_refused_naming_the_first":
        "two real extract processes",
    "tests/store/test_store_lock.py::test_a_dead_writers_lock_is_taken_over_in_one_line_and_verify_says_it_died":
        "kills a real writer and takes its lock over",
    # the command line as a user meets it: terminals, pipes, shells
    "tests/cli/test_cli.py::test_demo_default_model_per_layer_table": _DEFAULT,
    "tests/cli/test_cli_pipes_and_limits.py::test_progress_bar_on_a_terminal_unless_quiet": "runs under a real pty",
    "tests/cli/test_cli_pipes_and_limits.py::test_a_closed_pipe_ends_quietly": _CLI,
    "tests/probe/test_probe_cli.py::test_probe_command": _CLI,
    "tests/probe/test_probe_cli.py::test_probe_command_replaces_its_own_output_only_with_overwrite": _CLI,
    "tests/probe/test_probe_cli.py::test_results_go_to_stdout_and_progress_to_stderr_in_a_real_shell": _CLI,
    "tests/probe/test_probe.py::test_run_writes_every_output[ner]": "a whole layer study with every output written",
    "tests/probe/test_probe.py::test_cached_store_is_reused": "a layer study run twice",
    "tests/probe/test_isolated.py::test_the_child_extracts_what_the_run_would_and_the_run_never_loads_the_model":
        "extracts in a real child process",
    "tests/heads/test_heads_outputs_and_paths.py::test_probe_overwrite_is_real": _CLI,
    "tests/explore/test_explore.py::test_umap_projection": "UMAP's first call compiles with numba (about 20 s)",
    "tests/explore/test_explore.py::test_export_from_the_shell_shows_progress_and_no_third_party_noise": _CLI,
    "tests/explore/test_explore_page.py::test_corpus_view_and_layer_slider": "drives the page in a real browser",
    "tests/test_hardening.py::test_plots_keep_the_users_backend_and_write_pngs": "draws and writes real plots",
    "tests/test_dev.py::test_the_demo_environment_has_no_tensorflow_and_no_ray":
        "builds the demo environment the README's first command makes",
    "tests/test_structure.py::test_import_layerwise_is_light": "imports layerwise in a fresh interpreter",
    "tests/test_structure.py::test_subpackages_load_on_first_use": "imports each subpackage in a fresh interpreter",
    "tests/test_budget.py::test_in_ci_a_test_over_the_limit_fails_the_run_and_durations_are_written":
        "runs pytest itself twice",
    "tests/test_budget.py::test_a_slow_test_is_marked_and_a_name_that_matches_nothing_fails_a_whole_run_in_ci":
        "runs pytest itself twice",
    # the service: real subprocesses, timing and hostile clients
    "tests/serve/test_serve.py::test_ready_says_when_the_warmed_depths_are_prepared": _SERVER,
    "tests/serve/test_serve.py::test_concurrent_clients_batched_and_correct": "many concurrent clients",
    "tests/serve/test_serve_ceilings.py::test_a_slow_reader_that_keeps_reading_is_served":
        "a client that reads slowly is the point",
    "tests/serve/test_serve_ceilings.py::test_clients_that_never_read_are_dropped_and_their_answers_bounded":
        "waits for the send timeout to drop them",
    "tests/serve/test_kill_during_build.py::": "kills a real server while it builds a graph",
    "tests/serve/test_openapi.py::test_schemathesis_finds_nothing": "schemathesis generates hundreds of requests",
    "tests/serve/test_serve_hostile.py::test_serve_warns_when_bound_beyond_loopback_without_a_key": _SERVER,
    "tests/serve/test_serve_traffic.py::test_a_200kb_request_does_not_hold_up_a_one_text_request":
        "a 200 kB request against a one-text request",
    "tests/serve/test_serve_traffic.py::test_a_big_request_whose_client_gave_up_is_dropped_between_batches":
        "a big request abandoned mid-way",
    "tests/serve/test_serve_traffic.py::test_a_bad_cors_origin_stops_serve_naming_the_flag": _SERVER,
    "tests/cut/test_export_model.py::test_layerwise_serve_gives_the_exported_layer_to_the_openai_client": _SERVER,
    "tests/cut/test_export_servers.py::": "starts infinity and TEI-compatible servers on exported models",
    "tests/cli/test_cli_first_contact.py::test_progress_on_a_stderr_that_is_no_terminal_is_plain_periodic_lines":
        "runs extract three times in a child process whose stderr is no terminal",
    "tests/cli/test_cli_first_contact.py::test_train_without_dev_holds_out_its_dev_set_and_says_so":
        "trains a head on 500 records",
    "tests/corpus/test_files_as_users_have_them.py::test_train_reads_a_headerless_tsv_by_position":
        "trains a head on 500 records",
    # the documentation, run as written
    "tests/docs/test_shell_blocks.py::test_shell_block_runs_as_written":
        "every shell block of the README and the guides, as written: about 40 commands, each a Python process",
    "tests/docs/test_examples.py::test_notebook_runs": _NOTEBOOK,
    "tests/docs/test_doc_examples.py::test_readme_command_line_block_runs_as_written": _CLI,
    "tests/docs/test_doc_examples.py::test_sae_how_to_python_blocks_run_and_print_what_they_say":
        "trains a sparsify SAE, in the [sae] environment built beside the suite's (tests/sae_env.py), waited for",
    "tests/extraction/test_activations.py::test_sae_lens_trains_from_an_exported_store_with_falling_loss":
        "trains an SAE with SAELens, in the [sae] environment built beside the suite's (tests/sae_env.py), waited for",
    "tests/docs/test_doc_examples.py::test_openai_and_tei_client_examples_run_as_written": _SERVER,
    "tests/docs/test_doc_examples.py::test_readme_export_block_runs_and_its_serve_line_serves_the_export":
        "exports the default model, then serves it",
}

_durations: dict[str, float] = {}
_started = time.monotonic()


_unmatched: list[str] = []


def names(name: str, nodeid: str) -> bool:
    """Whether ``name`` in :data:`SLOW` or :data:`EXEMPT` names the test ``nodeid``: a module (``path::``), a test
    with all its parameters (``path::test``), or one parametrisation (``path::test[id]``)."""
    if name.endswith("::"):
        return nodeid.startswith(name)
    return nodeid == name or ("[" not in name and nodeid.startswith(name + "["))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each test :data:`SLOW` names ``slow``; on a whole-suite collection, notes the names matching nothing."""
    for item in items:
        if any(names(name, item.nodeid) for name in SLOW):
            item.add_marker(pytest.mark.slow)
    if _whole(config) and not config.option.markexpr and not config.option.keyword:
        ids = [item.nodeid for item in items]
        _unmatched[:] = [name for name in {**SLOW, **EXEMPT} if not any(names(name, i) for i in ids)]


def _whole(config: pytest.Config) -> bool:
    return [str(a) for a in config.args] in ([], ["tests"], [str(config.rootpath / "tests")])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def over_budget(durations: dict[str, float], wall: float, whole_suite: bool) -> list[str]:
    """What passed a limit: one line per test over :data:`TEST_LIMIT` that :data:`EXEMPT` does not name, and one
    for the suite's ``wall`` time over :data:`SUITE_LIMIT` (only when ``whole_suite``)."""
    lines = [f"{nodeid} took {seconds:.1f} s (the limit is {TEST_LIMIT:g} s): make it cheaper, or name it in "
             f"tests/budget.py EXEMPT with why it needs the time"
             for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])
             if seconds > TEST_LIMIT and not any(names(name, nodeid) for name in EXEMPT)]
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
    whole = _whole(session.config)
    problems = over_budget(_durations, wall, whole)
    problems += [f"{name!r} in tests/budget.py names no test: the test was renamed or removed, so update the list"
                 for name in _unmatched]
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
