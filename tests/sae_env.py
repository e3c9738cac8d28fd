"""The Python that runs the sparse-autoencoder trainers of the tests (SAELens, EleutherAI's sparsify): the suite's
own where the ``[sae]`` extra is installed in it, else an environment built for them beside it.

The extra's packages (sae-lens, transformer-lens, accelerate, wandb, eai-sparsify and some forty more) are not
installed into the suite's own environment by ``./dev setup``: with them importable in the pytest process, five
runs of the whole suite on 2026-11-29 ended in a segmentation fault at a child process's exit, in a different test
each time (a signal delivered with a stack the kernel could not use), while the same suite without them passed.
The tests that need them run the trainers in processes of their own anyway, so the trainers get an environment of
their own: a virtual environment whose ``.pth`` adds the suite's site-packages (layerwise, torch, transformers are
not installed twice) and into which pip installs only the extra's packages. It is built in the background when the
session collects those tests (:mod:`prebuilt`), in a couple of minutes that overlap the rest of the suite.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import prebuilt

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sae_lens", "sparsify")


def installed_here() -> bool:
    """The ``[sae]`` extra is installed in this environment."""
    return all(importlib.util.find_spec(p) is not None for p in PACKAGES)


def _extra_requirements() -> list[str]:
    """The ``[sae]`` extra's requirements, as pyproject.toml lists them."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return list(project["optional-dependencies"]["sae"])


def build(directory: Path) -> tuple[Path | None, str]:
    """A virtual environment in ``directory`` over this one, with the ``[sae]`` extra: its python (None when the
    build failed) and what pip said."""
    venv = directory / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    # this environment's site-packages after the new one's, with their own .pth files (layerwise's editable install)
    here = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    (site / "zz-layerwise-suite.pth").write_text(
        "".join(f"import site; site.addsitedir({p!r})\n" for p in here), encoding="utf-8")
    torch = importlib.util.find_spec("torch")
    pins = []
    if torch is not None:  # the CPU wheel this suite runs: an unpinned torch pulls several GB of CUDA packages
        import torch as _torch

        pins = [f"torch=={_torch.__version__.split('+')[0]}"]
    (directory / "constraints.txt").write_text("\n".join(pins) + "\n", encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                           "--disable-pip-version-check", "-c", str(directory / "constraints.txt"),
                           *_extra_requirements()], capture_output=True, text=True, timeout=900)
    return (python if done.returncode == 0 else None), done.stderr[-3000:]


def start() -> None:
    """Start building the environment in the background (nothing where the extra is installed here)."""
    if not installed_here():
        prebuilt.start("sae", build)


def python() -> str:
    """The Python to run SAELens and sparsify with: this one where the extra is installed, else the built one
    (waited for). Skips the test where it cannot be had, except in CI (``LAYERWISE_CI``), where it fails."""
    import pytest

    if installed_here():
        return sys.executable
    built, said = prebuilt.wait("sae", build)
    if built is None:
        why = f"the [sae] extra could not be installed beside the suite's environment: {said}"
        if os.environ.get("LAYERWISE_CI"):
            pytest.fail(why)
        pytest.skip(why)
    return str(built)
