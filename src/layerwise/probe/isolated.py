"""A probe run's feature extraction in a child process, so that the model never sits beside the loaded features.

A probe run that loads its own model (``model`` given as options, a path or ``None``, not as an
:class:`~layerwise.Extractor`) extracts every split in a child Python (``python -m layerwise.probe.isolated``) and
loads the features once the child has exited. Deleting the Extractor in the run's own process did not give its memory
back: the runtime's compiled graphs, thread pools and allocator arenas stayed resident (0.35 GB for the default model,
beside 1.24 GB of features on UD English-EWT), and the probes' peak memory was 1.7x the features instead of 1.35x.
The features are the same bytes either way: the child reads the same options and the same graph cache.

The child writes its progress and notices to the run's stderr. It never outlives the run (``PR_SET_PDEATHSIG`` and a
pipe from the parent, as :mod:`layerwise.model.backends.offload`'s children), and a killed extraction resumes from
its store. When the child cannot start or fails, the run extracts in its own process, where the same error, if any,
is raised with its real traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..model.backends.offload import PARENT, WATCH, child_setup, watch_parent
from ..model.options import ModelOptions


def extract_isolated(options: ModelOptions, jobs: list[dict[str, Any]], *, progress: bool | None,
                     overwrite: bool) -> bool:
    """Run :func:`~layerwise.probe.data.extract_split` for each of ``jobs`` (its keyword arguments: ``path``,
    ``store_dir``, ``task``, ``fmt``, ``column``, ...; strings, numbers, booleans or ``None``) with the model of
    ``options`` in a child process. ``True`` when the child did every job; ``False`` when it could not start or
    failed (the caller extracts in its own process)."""
    if progress is None:  # decided here, where stderr is the user's
        progress = sys.stderr.isatty()
    with tempfile.TemporaryDirectory(prefix="layerwise-probe-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"model": options.to_dict(), "progress": progress, "overwrite": overwrite,
                                       "jobs": [{k: os.fspath(v) if isinstance(v, os.PathLike) else v
                                                 for k, v in job.items()} for job in jobs]}), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the parent's imports, a source checkout too
        env[WATCH], env[PARENT] = "1", str(os.getpid())
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(request)], env=env, stdin=subprocess.PIPE)
        except OSError:
            return False
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted while waiting: the child goes with the run
                proc.kill()
                proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
    return code == 0


def main(argv: list[str] | None = None) -> int:
    """The child's entry: ``REQUEST.json``; exit 0 when every split is extracted, 1 when a
    :class:`~layerwise.LayerwiseError` stopped it (said by the run, which then does the same in its own process), and
    any other failure with its traceback on stderr."""
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(PARENT, "").isdigit():
        child_setup(int(os.environ[PARENT]), idle=False)
    if os.environ.get(WATCH) == "1":
        watch_parent()
    from ..errors import LayerwiseError
    from ..extractor import Extractor
    from .data import extract_split

    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    try:
        ex = Extractor.from_options(ModelOptions.from_dict(request["model"]))
        for job in request["jobs"]:
            extract_split(ex, job.pop("path"), Path(job.pop("store_dir")), progress=request["progress"],
                          overwrite=request["overwrite"], **job)
    except LayerwiseError:  # the user's error (a model, a file, a store): the run says it, doing the same itself
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
