"""``auto``'s policy without threads, models or clocks: exactness, the decision, whether a job waits for a compiled
runtime; and the preparer's Futures (one worker, a key per job, stop cancels what has not started)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from layerwise.model.backends import policy
from layerwise.model.backends.offload import Stopped
from layerwise.model.backends.policy import Decision, decide, pays_back, prior_gain
from layerwise.model.backends.preparer import Activity, Preparer

from tiny import wait_until


def test_agrees_within_the_scale_of_the_states():
    want = torch.zeros(2, 1, 3, 4)
    want[..., 0] = 100.0  # large states: the tolerance scales with them
    keep = torch.tensor([[True, True, False]])
    assert policy.agrees(want, want + 5e-4, keep)  # 5e-4 <= 1e-5 x 100
    assert not policy.agrees(want, want + 2e-3, keep)
    far = want.clone()
    far[:, :, 2] += 1.0  # a padding position: not compared
    assert policy.agrees(want, far, keep)
    bf = want.to(torch.bfloat16)
    assert policy.agrees(bf, bf, keep) and not policy.agrees(bf, -bf, keep)  # bf16: per-token cosine


def test_decide_fastest_takes_the_winner_where_exact():
    race = {"torch": 0.2, "onnx": 0.1, "openvino": 0.15}
    got = decide(3, "fastest", ["onnx", "openvino"], {"onnx": True, "openvino": True}, race=race)
    assert got.runtime == "onnx" and got.why.startswith("exact; fastest here: 100.0 ms vs PyTorch's 200.0 ms")
    inexact = decide(3, "fastest", ["onnx", "openvino"], {"onnx": False, "openvino": True}, race=race, known=True)
    assert inexact.runtime == "openvino" and "ONNX Runtime not exact there" in inexact.why
    assert "(timed earlier on this machine)" in inexact.why
    slower = decide(3, "fastest", ["onnx"], {"onnx": True}, race={"torch": 0.1, "onnx": 0.2})
    assert slower.runtime == "torch" and "PyTorch fastest here" in slower.why
    with pytest.raises(ValueError, match="needs a race"):
        decide(3, "fastest", ["onnx"], {"onnx": True})


def test_decide_named_and_none_exact():
    assert decide(2, "onnx", ["onnx", "openvino"], {"onnx": True}) == \
        Decision("onnx", "exact; LAYERWISE_AUTO_RUNTIME=onnx")
    assert decide(2, "torch", ["onnx"], {"onnx": True}) == Decision("torch", "LAYERWISE_AUTO_RUNTIME=torch")
    none = decide(2, "fastest", ["onnx", "openvino"], {"onnx": False, "openvino": False})
    assert none == Decision("torch", "ONNX Runtime, OpenVINO not within 1e-05 of PyTorch there")
    missing = decide(2, "openvino", ["onnx"], {})
    assert missing.runtime == "torch" and "(OpenVINO is not installed)" in missing.why
    assert "at a cosine of 0.999" in decide(2, "onnx", ["onnx"], {"onnx": False}, bf16=True).why


def test_a_job_waits_for_a_compiled_runtime_only_when_it_pays_back():
    assert not pays_back(torch_seconds=60, gain=1.2, prepare_seconds=30)  # saves 10 s for a 30 s wait
    assert pays_back(torch_seconds=3600, gain=1.2, prepare_seconds=30)  # saves 600 s
    assert not pays_back(torch_seconds=3600, gain=1.0, prepare_seconds=1)  # nothing to gain
    assert not pays_back(torch_seconds=0, gain=2.0, prepare_seconds=0)
    assert prior_gain({}) == policy.GAIN_PRIOR
    races = {"a": {"torch": 0.3, "onnx": 0.1}, "b": {"torch": 0.2, "onnx": 0.1, "openvino": 0.25},
             "c": {"torch": 0.1}}  # c: a race PyTorch ran alone, not a gain
    assert prior_gain(races) == pytest.approx(3.0)  # the median of 3.0 and 2.0 (the upper middle)


def test_runtime_choice_says_the_valid_values(monkeypatch):
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", " ONNX ")
    assert policy.runtime_choice() == "onnx"
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "gpu")
    with pytest.raises(ValueError, match="Valid values are: fastest, onnx, openvino, torch"):
        policy.runtime_choice()


def test_preparer_one_future_per_key_and_settle():
    prep = Preparer("test-prep")
    ran = []
    gate = threading.Event()

    def job(name: str):
        gate.wait(5)
        ran.append(name)
        return name

    first = prep.submit(("m", 1, "runtime"), lambda: job("a"), background=False)
    assert prep.submit(("m", 1, "runtime"), lambda: job("b"), background=False) is first  # the same job
    second = prep.submit(("m", 2, "runtime"), lambda: job("c"), background=False)
    assert prep.pending() == [("m", 1, "runtime"), ("m", 2, "runtime")] and not prep.settle(0.05)
    gate.set()
    assert prep.settle(5) and prep.pending() == [] and first.result() == "a" and second.result() == "c"
    assert ran == ["a", "c"]  # one worker: in order
    failed = prep.submit(("m", 3, "runtime"), lambda: 1 / 0, background=False)
    with pytest.raises(ZeroDivisionError):
        failed.result(5)
    assert prep.submit(("m", 3, "runtime"), lambda: 3, background=False).result(5) == 3  # a failure is retried
    prep.stop(5)


def test_preparer_stop_cancels_what_has_not_started():
    prep = Preparer("test-stop")
    started, release = threading.Event(), threading.Event()
    running = prep.submit(("m", 1, "runtime"), lambda: (started.set(), release.wait(5)), background=False)
    queued = prep.submit(("m", 2, "runtime"), lambda: "never", background=False)
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    prep.stop(5)
    assert queued.cancelled() and running.done() and not running.cancelled()
    late = prep.submit(("m", 3, "runtime"), lambda: "late")
    with pytest.raises(Stopped):
        late.result(1)


def test_background_jobs_wait_for_a_quiet_moment(monkeypatch):
    monkeypatch.setattr("layerwise.model.backends.preparer.QUIET_S", 0.2)
    activity, waiting = Activity(), threading.Event()
    quiet = Activity.quiet

    def watched(self, stop):  # the event that proves the job reached its wait
        waiting.set()
        return quiet(self, stop)

    monkeypatch.setattr(Activity, "quiet", watched)
    prep = Preparer("test-quiet", activity)
    ran = []
    with activity.calling():  # the caller is at work
        future = prep.submit(("m", 1, "runtime"), lambda: ran.append(time.monotonic()))
        assert waiting.wait(5)  # the background has the job and waits for a quiet moment
        assert not future.done()
        left = time.monotonic()
    future.result(5)
    assert ran[0] - left >= 0.19  # started once the caller was idle for QUIET_S
    prep.stop(5)


def test_alone_holds_the_callers_next_pass():
    activity, order = Activity(), []
    with activity.alone():
        def call():
            with activity.calling():
                order.append("caller")

        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: activity.held() == 1, 5, "the caller's pass waiting for the timing run")
        order.append("timing done")
    caller.join(5)
    assert order == ["timing done", "caller"]
