"""sentence-transformers' fastest CPU backends, run in a side environment so the main benchmark can time them.

What it is
    A helper for ``benchmarks/run.py``: :func:`ensure_env` builds a separate virtual environment with
    sentence-transformers (ST) and its ONNX and OpenVINO extras, and :class:`SideST` starts a worker process in it
    (this same file run as a script, ``<side python> -I benchmarks/st_side.py --worker ...``) and talks to it with
    JSON lines over stdin/stdout. The worker loads every contestant once in :meth:`SideST.prepare` (exports
    included) and then times exactly ``model.encode(texts, batch_size=batch_size, convert_to_numpy=True)`` with
    ``time.perf_counter`` inside its own process; embeddings come back through an ``.npy`` file, outside the timing.

    Contestants (the names are the keys of :meth:`SideST.prepare`'s result):

    * ``st-torch``    ``SentenceTransformer(model_path, device="cpu")`` (PyTorch backend)
    * ``st-onnx``     ``backend="onnx"``: optimum exports the PyTorch weights to ``onnx/model.onnx`` (in a copy of
                      the model directory under ``workdir``: the given one may be read-only, e.g. in site-packages)
    * ``st-onnx-O3``  ``export_optimized_onnx_model(model, "O3", ...)`` -> ``onnx/model_O3.onnx``
    * ``st-int8``     ``export_dynamic_quantized_onnx_model(model, <cfg>, ...)`` with cfg ``avx512_vnni``,
                      ``avx512`` or ``avx2`` after /proc/cpuinfo -> ``onnx/model_qint8_<cfg>.onnx``
    * ``st-openvino`` ``backend="openvino"``: optimum-intel exports the PyTorch weights to
                      ``openvino/openvino_model.xml`` (f32 IR, in a second copy of the model directory), run in f32
    * ``st-openvino-int8``  ``export_static_quantized_openvino_model(model, OVQuantizationConfig(num_samples=n), ...,
                      dataset_name=<local folder>, ...)`` -> ``openvino/openvino_model_qint8_quantized.xml``: NNCF
                      post-training static int8 (weights and activations), calibrated on the first ``n = min(300,
                      len(texts))`` prepared texts. ST calls ``datasets.load_dataset(dataset_name, ...)`` (glue/sst2
                      from the hub by default); the worker writes the texts to ``workdir/st-calib/train.jsonl`` and
                      passes that folder (config "default", split "train", column "sentence"), which loads offline.
                      It quantizes a fresh instance of the exported IR: the quantizer changes the model it is given
                      in place (quantizing st-openvino's own instance made st-openvino return int8 results).

    Threads: torch gets ``torch.set_num_threads(threads)`` (and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``); the ONNX
    contestants get an ``onnxruntime.SessionOptions`` with ``intra_op_num_threads=threads`` through ST's
    ``model_kwargs={"provider": "CPUExecutionProvider", "session_options": ...}``, which ST forwards to optimum's
    ``ORTModelForFeatureExtraction.from_pretrained``. The OpenVINO contestants get ``model_kwargs={"ov_config":
    {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY",
    "NUM_STREAMS": "1"}}``, which ST forwards to ``OVModelForFeatureExtraction.from_pretrained`` and optimum-intel
    to ``openvino.Core().compile_model``. The precision hint is needed: on a CPU with native bf16 (AMX, AVX512-BF16)
    OpenVINO's default ``INFERENCE_PRECISION_HINT`` is bf16, even for an f32 IR. LATENCY rather than THROUGHPUT:
    optimum-intel calls the compiled model synchronously, one batch at a time, so THROUGHPUT's several streams
    would each get a share of the threads with only one of them busy. The compiled model's own values of these
    properties, and the runtime precisions of its matrix products (``matmul_runtime_precisions``: all ``f32`` for
    st-openvino, ``u8``/``i8`` for st-openvino-int8), are in the facts.

Why a side environment
    ST's ONNX backend needs ``optimum[onnxruntime]``. Since optimum 2.x the ONNX parts live in ``optimum-onnx``,
    whose newest release (0.1.0) requires ``optimum~=2.1.0`` and ``transformers>=4.36,<4.58``, while this project
    runs transformers 5 (and sentence-transformers 6.x requires ``transformers>=5``). So the side env holds
    transformers 4.57.x with sentence-transformers 5.7.x (the newest accepting transformers 4), optimum 2.1 and
    optimum-onnx 0.1.0, and torch 2.13.0 (the same CPU build as the main env). The exact versions installed are
    recorded in ``benchmarks/.venv-st/.stamp.json`` and in every contestant's facts.

    Left unconstrained, pip resolves sentence-transformers 6.x first and then backtracks *optimum* down through
    1.27, 1.26, ... (old optimums without an upper bound on transformers); the requirement list therefore says
    ``transformers<4.58`` (the conflict itself) and ``optimum[onnxruntime]>=2.1``.

    ST's OpenVINO backend needs ``optimum-intel[openvino]``. optimum-intel 2.x requires ``optimum~=2.2.0`` (2.0) or
    ``optimum~=2.3.0`` (2.1, 2.2), which optimum-onnx 0.1.0's ``optimum~=2.1.0`` excludes; optimum-intel 1.27.0 is
    the newest release that coexists with it (it requires ``optimum-onnx~=0.1.0``, ``transformers>=4.45,<4.58``,
    ``openvino>=2025.4``, ``nncf>=2.19``), so the list pins ``optimum-intel[openvino]~=1.27.0`` (pip installs
    openvino and openvino-tokenizers 2026.4.x, nncf 3.x with it). ``datasets`` is for st-openvino-int8's calibration
    set (ST's quantization function requires it even with a local folder); ``datasets<5`` because datasets 5
    requires ``huggingface-hub>=1.31`` and transformers 4.57 ``huggingface-hub<1.0``.

How to run
    From the main venv (this module imports only the standard library and numpy)::

        from benchmarks.st_side import SideST
        with SideST(model_path, threads=2, workdir=Path(tmp)) as side:
            facts = side.prepare(texts)                 # builds benchmarks/.venv-st on first use (~2.5 min)
            seconds, emb = side.encode("st-onnx", texts, batch_size=32)

    ``python benchmarks/st_side.py --ensure-env`` builds the env alone and prints its python's path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_ROOT = HERE / ".venv-st"

# Installed in this order. torch first and pinned: it comes from the local CPU wheel in seconds (an unpinned torch
# would pull gigabytes of CUDA wheels); it is repeated in the second step so that pip keeps it.
REQUIREMENTS: tuple[tuple[str, ...], ...] = (
    ("torch==2.13.0",),
    ("torch==2.13.0", "transformers<4.58", "sentence-transformers", "optimum[onnxruntime]>=2.1",
     "optimum-intel[openvino]~=1.27.0", "datasets<5"),
)
VERSIONED = (
    "torch",
    "transformers",
    "sentence-transformers",
    "optimum",
    "optimum-onnx",
    "onnxruntime",
    "onnx",
    "optimum-intel",
    "openvino",
    "openvino-tokenizers",
    "nncf",
    "datasets",
    "numpy",
    "tokenizers",
    "huggingface-hub",
)
CONTESTANTS = ("st-torch", "st-onnx", "st-onnx-O3", "st-int8", "st-openvino", "st-openvino-int8")
STAMP = ".stamp.json"


def _requirements_hash() -> str:
    blob = json.dumps({"requirements": REQUIREMENTS, "python": sys.version_info[:2]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _venv_python(root: Path) -> Path:
    return root / "bin" / "python"


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def ensure_env(root: Path = DEFAULT_ROOT) -> Path:
    """Create (once) the side venv at ``root`` and return its python.

    Idempotent: a stamp file holds a hash of :data:`REQUIREMENTS` (and the Python version); when it matches, nothing
    is done. Otherwise the venv is (re)created with ``python -m venv --clear`` from this interpreter, torch is
    installed first, then the rest; the stamp (with the installed versions and the install time) is written last,
    so an interrupted install is redone on the next call.
    """
    import fcntl

    root = Path(root)
    py = _venv_python(root)
    want = _requirements_hash()
    root.parent.mkdir(parents=True, exist_ok=True)
    # The lock lives outside root (venv --clear empties root) and outside the repository.
    tag = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:12]
    lock_path = Path(tempfile.gettempdir()) / f"st_side-{tag}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            stamp = json.loads((root / STAMP).read_text())
        except (OSError, ValueError):
            stamp = {}
        if stamp.get("hash") == want and py.exists():
            return py

        print(f"st_side: installing the side env at {root} (sentence-transformers + optimum[onnxruntime] + "
              "optimum-intel[openvino], about 2-3 minutes, once)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        # The base interpreter, so the side env does not inherit this venv; same Python version (cp311 wheels).
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", "--clear", str(root)], check=True)
        log = root / "install.log"
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        for step in REQUIREMENTS:
            with open(log, "a") as out:
                out.write(f"\n$ pip install {' '.join(step)}\n")
                out.flush()
                rc = subprocess.run([str(py), "-m", "pip", "install", *step], stdout=out, stderr=subprocess.STDOUT,
                                    env=env).returncode
            if rc != 0:
                raise RuntimeError(f"st_side: pip install {' '.join(step)} failed (rc {rc}); see {log}:\n"
                                   + _tail(log))
        code = ("import json, importlib.metadata as m\n"
                "def v(n):\n    try:\n        return m.version(n)\n"
                "    except m.PackageNotFoundError:\n        return None\n"
                f"print(json.dumps({{n: v(n) for n in {list(VERSIONED)!r}}}))")
        versions = json.loads(subprocess.run([str(py), "-I", "-c", code], check=True, capture_output=True,
                                             text=True).stdout)
        stamp = {"hash": want, "requirements": REQUIREMENTS, "versions": versions,
                 "install_s": round(time.perf_counter() - t0, 1)}
        (root / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        print(f"st_side: side env ready in {stamp['install_s']} s: {versions}", file=sys.stderr, flush=True)
        return py


class SideST:
    """A worker process in the side env holding sentence-transformers contestants; a context manager.

    ``prepare(texts)`` loads/exports every contestant (outside any timing) and sends ``texts`` once;
    ``encode(name, texts, batch_size)`` returns ``(seconds, embeddings)`` timed inside the worker. Errors from the
    worker raise ``RuntimeError`` (with the worker's traceback, or its stderr tail when it died).
    """

    def __init__(self, model_path: str, threads: int, workdir: Path, python: Path | None = None):
        self.model_path = str(model_path)
        self.threads = int(threads)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = self.workdir / "st_side_worker.stderr.log"
        self._python = python
        self._proc: subprocess.Popen | None = None
        self._stderr_file = None
        self._texts: list[str] | None = None  # the texts sent with prepare (key "prepared" in the worker)
        self._sent: set[str] = set()  # keys of other text lists already held by the worker
        self.facts: dict[str, dict] = {}

    # -- process ---------------------------------------------------------------------------------------------
    def start(self) -> SideST:
        if self._proc is not None:
            return self
        py = Path(self._python) if self._python else ensure_env()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", PYTHONNOUSERSITE="1",
                   # datasets caches st-openvino-int8's calibration set under optimum-intel's cache_dir default,
                   # huggingface_hub's HUGGINGFACE_HUB_CACHE = $HF_HOME/hub: keep it in workdir, not in ~/.cache
                   HF_HOME=str(self.workdir / "hf-home"))
        self._stderr_file = open(self.stderr_path, "w")
        # -I: isolated (no script dir on sys.path, so benchmarks/*.py can not shadow libraries; no user site).
        cmd = [str(py), "-I", str(Path(__file__).resolve()), "--worker", "--model", self.model_path,
               "--threads", str(self.threads), "--workdir", str(self.workdir)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr_file,
                                      text=True, bufsize=1, env=env)
        self._call({"op": "hello"})
        return self

    def __enter__(self) -> SideST:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the exception in flight behind a second one from close()
            try:
                self.close()
            except RuntimeError:
                pass

    def _stop(self, kill: bool = False) -> int | None:
        """Forget the worker: kill it if asked (or if it does not exit), close the pipes; returns its exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            if kill and proc.poll() is None:
                proc.kill()
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        finally:
            for f in (proc.stdin, proc.stdout, self._stderr_file):
                try:
                    if f:
                        f.close()
                except OSError:
                    pass
            self._stderr_file = None
        return rc

    def _died(self, what: str, kill: bool = False) -> RuntimeError:
        rc = self._stop(kill=kill)
        return RuntimeError(f"st_side worker {what} (exit code {rc}); stderr tail ({self.stderr_path}):\n"
                            + _tail(self.stderr_path))

    def _call(self, req: dict) -> dict:
        if self._proc is None:
            raise RuntimeError("st_side worker is not running (use SideST as a context manager or call start())")
        try:
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            raise self._died(f"died during {req.get('op')!r}")
        try:
            resp = json.loads(line)
        except ValueError:
            raise self._died(f"sent a line that is not JSON: {line[:200]!r}", kill=True) from None
        if not resp.get("ok"):
            raise RuntimeError(f"st_side worker failed on {req.get('op')!r}: {resp.get('error')}\n"
                               f"{resp.get('traceback', '')}")
        return resp

    def close(self) -> None:
        """Stop the worker cleanly (idempotent); raises RuntimeError with its stderr tail if it had died."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                proc.stdin.flush()
                proc.stdout.readline()
            except (BrokenPipeError, OSError):
                pass
        rc = proc.poll() if proc.poll() is not None else None
        if rc is None:
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rc = None
        if rc == 0:
            self._stop()
        else:
            raise self._died("exited badly" if rc is not None else "did not stop; killed", kill=True)

    # -- API -------------------------------------------------------------------------------------------------
    def prepare(self, texts: list[str]) -> dict[str, dict]:
        """Load/export every contestant once and keep ``texts`` in the worker; returns facts per contestant name.

        A contestant that failed has ``{"ok": False, "error": ...}`` and is left out of :attr:`names`.
        """
        self.start()
        self._texts = list(texts)
        self.facts = self._call({"op": "prepare", "texts": self._texts})["facts"]
        return self.facts

    @property
    def names(self) -> list[str]:
        """The contestants that loaded (in :data:`CONTESTANTS` order)."""
        return [n for n in CONTESTANTS if self.facts.get(n, {}).get("ok")]

    def encode(self, name: str, texts: list[str] | None = None, batch_size: int = 32,
               n: int | None = None) -> tuple[float, np.ndarray]:
        """Time ``model.encode(texts, batch_size=batch_size, convert_to_numpy=True)`` in the worker.

        ``texts``: None or a prefix of the prepared texts -> only a count is sent (``n`` alone also takes the first
        ``n`` prepared texts); any other list is sent once and then cached in the worker by its hash. Returns
        ``(seconds, embeddings)`` with embeddings float32 ``[len(texts), dim]``.
        """
        req: dict = {"op": "encode", "name": name, "batch_size": int(batch_size)}
        if texts is None or (self._texts is not None and len(texts) <= len(self._texts)
                             and list(texts) == self._texts[: len(texts)]):
            if self._texts is None:
                raise RuntimeError("call prepare(texts) first")
            req["key"] = "prepared"
            req["n"] = len(self._texts) if texts is None else len(texts)
            if n is not None:
                req["n"] = min(req["n"], int(n))
        else:
            texts = list(texts)
            key = hashlib.sha1(json.dumps(texts).encode()).hexdigest()
            req["key"] = key
            if key not in self._sent:
                req["texts"] = texts
            if n is not None:
                req["n"] = int(n)
        resp = self._call(req)
        if "texts" in req:
            self._sent.add(req["key"])
        path = Path(resp["npy"])
        emb = np.load(path)
        path.unlink(missing_ok=True)
        return float(resp["seconds"]), emb.astype(np.float32, copy=False)


# ------------------------------------------------------------------------------------------------------------------
# The worker: runs in the side env only (imports torch, sentence_transformers, optimum lazily, never layerwise).


def _cpu_quant_config() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    if "avx512f" in flags:
        return "avx512"
    return "avx2"


class _Worker:
    def __init__(self, model_path: str, threads: int, workdir: Path):
        import torch

        torch.set_num_threads(threads)
        self.model_path = model_path
        self.threads = threads
        self.workdir = workdir
        self.models: dict = {}
        self.texts: dict[str, list[str]] = {}
        self.versions = self._versions()

    @staticmethod
    def _versions() -> dict:
        import importlib.metadata as md

        out = {}
        for n in VERSIONED:
            try:
                out[n] = md.version(n)
            except md.PackageNotFoundError:
                out[n] = None
        return out

    def _onnx_kwargs(self, file_name: str | None = None) -> dict:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        kw = {"provider": "CPUExecutionProvider", "session_options": so}
        if file_name:
            kw["file_name"] = file_name
        return kw

    def _ov_kwargs(self, file_name: str | None = None) -> dict:
        # Explicit precision (f32: OpenVINO would otherwise run f32 models in bf16 on CPUs with native bf16) and
        # threads. LATENCY (optimum-intel's default, given here explicitly): OVModel calls the compiled model
        # synchronously, one request at a time, so THROUGHPUT's extra streams would only split the threads.
        kw: dict = {"ov_config": {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": str(self.threads),
                                  "PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}}
        if file_name:
            kw["file_name"] = file_name
        return kw

    @staticmethod
    def _ov_facts(model) -> dict:
        """The compiled model's settings as OpenVINO reports them, and the precisions its matrix products run in."""
        try:
            cm = model.transformers_model.request
            out: dict = {}
            for key in ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "PERFORMANCE_HINT", "NUM_STREAMS",
                        "EXECUTION_DEVICES"):
                try:
                    v = cm.get_property(key)
                    out[key] = v.to_string() if hasattr(v, "to_string") else str(v)  # ov.Type -> "f32"
                except Exception as e:  # facts only
                    out[key] = f"unavailable: {e!r}"
            prec: dict[str, int] = {}
            for op in cm.get_runtime_model().get_ops():
                rt = op.get_rt_info()
                if str(rt["layerType"].astype(str)) in ("FullyConnected", "MatMul"):
                    p = str(rt["runtimePrecision"].astype(str))
                    prec[p] = prec.get(p, 0) + 1
            out["matmul_runtime_precisions"] = prec
            return out
        except Exception as e:  # facts only
            return {"ov_facts_error": repr(e)}

    @staticmethod
    def _session_facts(model) -> dict:
        try:
            sess = model.transformers_model.session
            so = sess.get_session_options()
            path = getattr(sess, "_model_path", None)
            return {"providers": sess.get_providers(), "intra_op_num_threads": so.intra_op_num_threads,
                    "graph_optimization_level": str(so.graph_optimization_level),
                    "session_model_path": str(path) if path else None}
        except Exception as e:  # facts only
            return {"session_facts_error": repr(e)}

    def _load(self, name: str, fn, texts: list[str]) -> dict:
        import torch

        t0 = time.perf_counter()
        try:
            model, facts = fn()
            facts["load_s"] = round(time.perf_counter() - t0, 3)
            t1 = time.perf_counter()
            model.encode(texts[:32], batch_size=32, convert_to_numpy=True)  # warm-up, outside any timing
            facts["warmup_s"] = round(time.perf_counter() - t1, 3)
        except Exception as e:
            traceback.print_exc()
            return {"ok": False, "error": f"{type(e).__name__}: {e}", "seconds": round(time.perf_counter() - t0, 3)}
        self.models[name] = model
        return {"ok": True, "torch_threads": torch.get_num_threads(), "versions": self.versions, **facts}

    def prepare(self, req: dict) -> dict:
        from sentence_transformers import (
            SentenceTransformer,
            export_dynamic_quantized_onnx_model,
            export_optimized_onnx_model,
        )

        texts = req["texts"]
        self.texts["prepared"] = texts
        self.models.clear()
        facts: dict[str, dict] = {}
        mdir = self.workdir / "st-model"
        state: dict = {}

        def torch_model():
            m = SentenceTransformer(self.model_path, device="cpu")
            return m, {"backend": "torch", "model_path": self.model_path}

        def exported(directory: Path, backend: str, kwargs, rel: str):
            """ST's own export of a fresh copy of the model to ``backend``, saved, then loaded from ``rel``."""
            if directory.exists():
                shutil.rmtree(directory)
            shutil.copytree(self.model_path, directory, ignore=shutil.ignore_patterns("onnx", "openvino"))
            t0 = time.perf_counter()
            SentenceTransformer(str(directory), device="cpu", backend=backend,
                                model_kwargs=kwargs()).save_pretrained(str(directory))
            export_s = time.perf_counter() - t0
            m = SentenceTransformer(str(directory), device="cpu", backend=backend, model_kwargs=kwargs(rel))
            state[backend] = m
            return m, export_s

        def onnx_model():
            m, export_s = exported(mdir, "onnx", self._onnx_kwargs, "onnx/model.onnx")
            f = mdir / "onnx" / "model.onnx"
            return m, {"backend": "onnx", "export_s": round(export_s, 3), "onnx_file": str(f),
                       "onnx_bytes": f.stat().st_size, **self._session_facts(m)}

        def derived(kind: str):
            def load():
                base = state.get("onnx")
                if base is None:
                    raise RuntimeError("st-onnx failed, nothing to derive from")
                t0 = time.perf_counter()
                if kind == "O3":
                    export_optimized_onnx_model(base, "O3", str(mdir))
                    rel, extra = "onnx/model_O3.onnx", {"optimization": "O3"}
                else:
                    cfg = _cpu_quant_config()
                    export_dynamic_quantized_onnx_model(base, cfg, str(mdir))
                    # ST names it model_<weights dtype>_<cfg>.onnx: qint8 for avx512*, quint8 for avx2
                    found = sorted((mdir / "onnx").glob(f"model_*int8_{cfg}.onnx"))
                    if not found:
                        raise FileNotFoundError(f"no onnx/model_*int8_{cfg}.onnx after the export")
                    rel, extra = f"onnx/{found[0].name}", {"quantization_config": cfg}
                export_s = time.perf_counter() - t0
                m = SentenceTransformer(str(mdir), device="cpu", backend="onnx", model_kwargs=self._onnx_kwargs(rel))
                f = mdir / rel
                return m, {"backend": "onnx", "export_s": round(export_s, 3), "onnx_file": str(f),
                           "onnx_bytes": f.stat().st_size, **extra, **self._session_facts(m)}
            return load

        ovdir = self.workdir / "st-model-ov"

        def openvino_model():
            rel = "openvino/openvino_model.xml"
            m, export_s = exported(ovdir, "openvino", self._ov_kwargs, rel)
            f = ovdir / rel
            return m, {"backend": "openvino", "export_s": round(export_s, 3), "ov_file": str(f),
                       "ov_bin_bytes": f.with_suffix(".bin").stat().st_size, **self._ov_facts(m)}

        def openvino_int8():
            from optimum.intel import OVQuantizationConfig
            from sentence_transformers import export_static_quantized_openvino_model

            if "openvino" not in state:
                raise RuntimeError("st-openvino failed, nothing to quantize")
            # A fresh copy to quantize: OVQuantizer works on the model it is given in place (quantizing st-openvino's
            # own instance turned its outputs into the int8 model's).
            base = SentenceTransformer(str(ovdir), device="cpu", backend="openvino",
                                       model_kwargs=self._ov_kwargs("openvino/openvino_model.xml"))
            # The calibration set: the first (up to) 300 prepared texts, as a local dataset folder (a hub dataset
            # name is what ST passes to datasets.load_dataset by default; a local folder loads offline).
            calib = self.workdir / "st-calib"
            if calib.exists():
                shutil.rmtree(calib)
            calib.mkdir(parents=True)
            n = min(300, len(texts))
            with open(calib / "train.jsonl", "w") as f:
                for t in texts[:n]:
                    f.write(json.dumps({"sentence": t}) + "\n")
            t0 = time.perf_counter()
            export_static_quantized_openvino_model(base, OVQuantizationConfig(num_samples=n), str(ovdir),
                                                   dataset_name=str(calib), dataset_config_name="default",
                                                   dataset_split="train", column_name="sentence")
            export_s = time.perf_counter() - t0
            rel = "openvino/openvino_model_qint8_quantized.xml"
            m = SentenceTransformer(str(ovdir), device="cpu", backend="openvino", model_kwargs=self._ov_kwargs(rel))
            f = ovdir / rel
            return m, {"backend": "openvino", "export_s": round(export_s, 3), "ov_file": str(f),
                       "ov_bin_bytes": f.with_suffix(".bin").stat().st_size, "calibration_texts": n,
                       "quantization": "static int8 (OVQuantizationConfig, NNCF post-training)",
                       **self._ov_facts(m)}

        for name, fn in (("st-torch", torch_model), ("st-onnx", onnx_model), ("st-onnx-O3", derived("O3")),
                         ("st-int8", derived("int8")), ("st-openvino", openvino_model),
                         ("st-openvino-int8", openvino_int8)):
            print(f"st_side worker: preparing {name}", file=sys.stderr, flush=True)
            facts[name] = self._load(name, fn, texts)
        return {"facts": facts}

    def encode(self, req: dict) -> dict:
        name = req["name"]
        if name not in self.models:
            raise KeyError(f"no contestant {name!r} (loaded: {sorted(self.models)})")
        if "texts" in req:
            self.texts[req["key"]] = req["texts"]
        texts = self.texts[req["key"]]
        if req.get("n") is not None:
            texts = texts[: req["n"]]
        model, batch_size = self.models[name], req["batch_size"]
        t0 = time.perf_counter()
        emb = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
        seconds = time.perf_counter() - t0
        path = self.workdir / f"st_side_{name}_{os.getpid()}.npy"
        np.save(path, np.asarray(emb, dtype=np.float32))
        return {"seconds": seconds, "npy": str(path), "shape": list(emb.shape)}


def _worker_main(args: argparse.Namespace) -> int:
    # Protocol lines go to a private duplicate of the real stdout; fd 1 and sys.stdout now point at stderr, so
    # stray prints, progress bars and C-level writes from libraries can not corrupt the protocol.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    worker = None
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "hello":
                resp = {"pid": os.getpid(), "python": sys.executable}
            elif op == "close":
                send({"ok": True})
                return 0
            else:
                if worker is None:
                    worker = _Worker(args.model, args.threads, Path(args.workdir))
                resp = getattr(worker, op)(req) if op in ("prepare", "encode") else None
                if resp is None:
                    raise ValueError(f"unknown op {op!r}")
            send({"ok": True, **resp})
        except Exception as e:
            traceback.print_exc()
            send({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="run the JSON-lines worker (in the side env)")
    p.add_argument("--ensure-env", action="store_true", help="build the side env and print its python")
    p.add_argument("--model")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir")
    args = p.parse_args(argv)
    if args.worker:
        return _worker_main(args)
    if args.ensure_env:
        print(ensure_env())
        return 0
    p.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
