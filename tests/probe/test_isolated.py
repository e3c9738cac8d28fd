"""A probe run that loads its own model extracts in a child process (``layerwise.probe.isolated``): the same
features as an extraction in the run's own process, the run's process never loads the model, a child that cannot
start leaves the work to the run, and a user's error is said once, by the run, without a child's traceback."""

from __future__ import annotations

import pytest

import layerwise as lw
import layerwise.probe.isolated as isolated
from layerwise.errors import ModelLoadError
from layerwise.extractor import Extractor
from layerwise.probe import ProbeConfig, run

CONLLU = """# sent_id = 1
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\tdog\tdog\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\truns\trun\tVERB\tVBZ\t_\t0\troot\t_\t_

# sent_id = 2
1\tA\ta\tDET\tDT\t_\t2\tdet\t_\t_
2\tcat\tcat\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tsleeps\tsleep\tVERB\tVBZ\t_\t0\troot\t_\t_

"""

QUIET = dict(log=lambda line: None, progress=False)


@pytest.fixture
def ud(tmp_path):
    path = tmp_path / "ud.conllu"
    path.write_text(CONLLU)
    return path


def _features(out):
    """Every feature shard's tensors (their bytes) and the runtime that computed them (a store's id and creation
    time are its own)."""
    from safetensors import safe_open

    found = {}
    for p in sorted((out / "features").rglob("*.safetensors")):
        with safe_open(str(p), "np") as f:
            found[p.relative_to(out)] = ({k: f.get_tensor(k).tobytes() for k in f.keys()}, f.metadata()["runtime"])
    return found


def test_the_child_extracts_what_the_run_would_and_the_run_never_loads_the_model(tmp_path, ud, tiny_dirs,
                                                                                monkeypatch):
    options = lw.ModelOptions(model=str(tiny_dirs["bert"]), device="cpu")
    here = run(ud, ud, config=ProbeConfig(column="upos", layers_only=True), model=Extractor.from_options(options),
               output=tmp_path / "here", **QUIET)

    def refuse(*args, **kwargs):
        raise AssertionError("the run's own process loaded the model")

    monkeypatch.setattr(Extractor, "from_options", classmethod(refuse))  # the child is another process
    child = run(ud, ud, config=ProbeConfig(column="upos", layers_only=True), model=options,
                output=tmp_path / "child", **QUIET)
    assert _features(tmp_path / "child") == _features(tmp_path / "here") != {}
    assert child.provenance["model"] == here.provenance["model"]
    assert child.provenance["num_layers"] == here.provenance["num_layers"] == 2
    assert [r["dev_mean"] for r in child.rows] == [r["dev_mean"] for r in here.rows]


def test_a_child_that_cannot_start_leaves_the_extraction_to_the_run(tmp_path, ud, tiny_dirs, monkeypatch):
    def no_child(*args, **kwargs):
        raise OSError("no interpreter")

    monkeypatch.setattr(isolated.subprocess, "Popen", no_child)
    loaded = []
    real = Extractor.from_options.__func__

    def counted(cls, options):
        loaded.append(options)
        return real(cls, options)

    monkeypatch.setattr(Extractor, "from_options", classmethod(counted))
    res = run(ud, ud, config=ProbeConfig(column="upos", layers_only=True),
              model=lw.ModelOptions(model=str(tiny_dirs["bert"]), device="cpu"), output=tmp_path / "o", **QUIET)
    assert len(loaded) == 1 and res.provenance["num_layers"] == 2


def test_a_bad_model_is_said_once_by_the_run_without_a_child_traceback(tmp_path, ud, capfd):
    with pytest.raises(ModelLoadError):
        run(ud, ud, config=ProbeConfig(column="upos"), model=str(tmp_path / "no-such-model"), output=tmp_path / "o",
            **QUIET)
    assert "Traceback" not in capfd.readouterr().err
