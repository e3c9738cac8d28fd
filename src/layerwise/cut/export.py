"""``export_model``: a chosen layer (or mix of layers) written as a model every other tool loads, and checked.

The steps: load the source model (PyTorch, float32), plan the export (:mod:`layerwise.cut.plan`: what can be
written, or a refusal that names the alternatives), compute layerwise's reference on the fixed probe set, cut the
model after layer ``K`` (``K + 1`` for a raw layer read before a final norm) and write it with its tokenizer
(:mod:`layerwise.cut.checkpoint`) and the sentence-transformers files (:mod:`layerwise.cut.st_modules`) into a
directory beside the output, check that directory with plain transformers and sentence-transformers
(:mod:`layerwise.cut.verify`), write ``layerwise-export.json``, and only then move it into place. A failed check
leaves nothing at the output and raises :class:`~layerwise.ExportError` with the measured numbers.

The output directory is never one the user wrote: it must not exist, be empty, or hold an earlier layerwise export
(its ``layerwise-export.json``), which is replaced only with ``overwrite=True``.

Example::

    >>> import layerwise as lw
    >>> result = lw.export_model("minilm-l3", layers=3, pool="mean", normalize=True)      # doctest: +SKIP
    >>> result.report["checks"]["transformers"]["max_abs_diff"] <= 1e-5                   # doctest: +SKIP
    True
    >>> from sentence_transformers import SentenceTransformer
    >>> SentenceTransformer("minilm-l3").encode(["I love Paris"]).shape                    # doctest: +SKIP
    (1, 384)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..encoding.layers import LayerSpec
from ..encoding.spec import EncodeSpec
from ..errors import ExportError
from ..model.options import ModelOptions
from ..outputs import OwnedOutput
from ..version import __version__
from .plan import ExportPlan, ModelFacts, plan_export, serve_alias

if TYPE_CHECKING:
    from ..extractor import Extractor
    from .verify import Reference

REPORT_NAME = "layerwise-export.json"
FORMAT = "layerwise-export"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ExportResult:
    """A written and checked export.

    Attributes:
        directory: where it is: a Hugging Face directory that is also a sentence-transformers model.
        report: the contents of its ``layerwise-export.json`` (source, plan, files, checks).
    """

    directory: Path
    report: dict[str, Any]

    @property
    def passed(self) -> bool:
        """Every check that ran passed (an export is only returned when they did)."""
        return bool(self.report["passed"])

    def _repr_html_(self) -> str:
        """The summary as an escaped HTML card (notebooks)."""
        from ..display import card

        lines = self.summary().splitlines()
        return card("ExportResult", [("directory", str(self.directory)), *((f"check {i}", line)
                                     for i, line in enumerate(lines[1:], 1))], f"<div>{_esc(lines[0])}</div>")

    @property
    def serve_alias(self) -> str:
        """The ``layerwise serve --model DIR --alias NAME='...'`` fields that serve the exported spec from the
        directory."""
        return str(self.report["export"]["serve_alias"])

    def summary(self) -> str:
        """One line per check, with the measured numbers."""
        checks = self.report["checks"]
        tf = checks["transformers"]
        export = self.report["export"]
        kept = export["layers_kept"]
        read = ""
        if kept != export["layers"]:
            read = f"; it holds {kept} layers and reads {export['read']}, before the final norm"
        lines = [f"{self.directory}: layer {export['layers']} of {self.report['source']['num_layers']} "
                 f"of {self.report['source']['model']} ({export['bytes'] / 2**20:,.1f} MiB, "
                 f"{export['weights_dtype']}{read})",
                 f"transformers {tf['class']}: max |diff| {tf['max_abs_diff']:.2e} over {tf['layers_compared']} "
                 f"(bound {tf['bound']:.0e})"]
        st = checks["sentence_transformers"]
        if st.get("checked"):
            lines.append(f"sentence-transformers {st['version']} ({' > '.join(st['modules'])}): min cosine "
                         f"{st['min_cosine']:.7f} (bound {st['bound']}), max |diff| {st['max_abs_diff']:.2e}")
        else:
            lines.append(f"sentence-transformers: not checked: {st['why']}")
        return "\n".join(lines)


def _esc(text: str) -> str:
    from ..display import esc

    return esc(text)


def _source_options(model: ModelOptions | str | os.PathLike | None, options: dict[str, Any]) -> ModelOptions:
    """The source's options, run on PyTorch float32 (what the export is checked against)."""
    opts = ModelOptions.of(model, **options)
    if opts.backend not in (None, "auto", "torch"):
        raise ExportError(f"backend={opts.backend!r}: an export writes the model's PyTorch weights and is checked on "
                          f"PyTorch; drop backend (CLI --backend) or pass backend='torch'")
    if opts.quantize is not None:
        raise ExportError(f"quantize={opts.quantize!r}: an export writes the model's own weights; drop quantize")
    if opts.compute_dtype not in (None, "float32"):
        raise ExportError(f"compute_dtype={opts.compute_dtype!r}: an export is checked in float32 (its weights keep "
                          f"the source's own precision: a bfloat16 checkpoint is written in bfloat16); drop it")
    return opts.replace(backend="torch")


def owned_output(output: Path) -> OwnedOutput:
    """The export directory as an :class:`~layerwise.outputs.OwnedOutput` (its marker: ``layerwise-export.json``;
    its own entries: the files that report lists, and the report)."""
    return OwnedOutput(output, "directory", "layerwise export", owned=is_export,
                       marker=f"{REPORT_NAME} of a layerwise export", own_entries=_own_entries, error=ExportError)


def _listed(output: Path) -> set[str]:
    return set(json.loads((output / REPORT_NAME).read_text(encoding="utf-8"))["export"].get("files", []))


def _own_entries(output: Path) -> list[str]:
    """The top-level entries of an earlier export (the files its report lists, and the report)."""
    return sorted({name.split("/", 1)[0] for name in _listed(output)} | {REPORT_NAME})


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an output that is a file, or a non-empty directory that is not an earlier layerwise export (or is one
    and ``overwrite`` is not set, or holds files the export did not write)."""
    owned_output(output).check(overwrite)
    if not output.is_dir() or not any(output.iterdir()):
        return
    listed = _listed(output)
    added = sorted(str(p.relative_to(output)) for p in output.rglob("*")
                   if p.is_file() and str(p.relative_to(output)) not in listed | {REPORT_NAME})
    if added:
        shown = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
        raise ExportError(f"{output} holds an earlier layerwise export and files it did not write ({shown}); they "
                          f"are never replaced. Move them out, or choose another output (-o)")


def is_export(directory: Path) -> bool:
    """Whether ``directory`` holds a layerwise export (its ``layerwise-export.json`` with the format marker)."""
    try:
        data = json.loads((directory / REPORT_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def _place(built: Path, output: Path, overwrite: bool) -> None:
    """Move the checked ``built`` directory to ``output``, checking the output again first (it may have changed
    while the export ran); an earlier export's entries are replaced only once the new ones are there
    (:meth:`OwnedOutput.place <layerwise.outputs.OwnedOutput.place>`)."""
    check_output(output, overwrite)
    owned_output(output).place(built, overwrite=overwrite)


def _remove_stale(output: Path) -> None:
    """Remove what an interrupted export to ``output`` left beside it (``.NAME.partial-PID`` or
    ``.NAME.replaced-PID`` of a process that is gone): layerwise's own names, never the user's files."""
    for path in output.parent.glob(f".{output.name}.*-*"):
        kind, _, pid = path.name.removeprefix(f".{output.name}.").rpartition("-")
        if kind not in ("partial", "replaced") or not pid.isdigit() or not path.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # that export is still running
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


def _files(directory: Path) -> tuple[list[str], int]:
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    return files, sum((directory / f).stat().st_size for f in files)


def export_model(
    output: str | os.PathLike,
    model: ModelOptions | str | os.PathLike | None = None,
    *,
    layers: LayerSpec = -1,
    pool: str = "mean",
    normalize: bool = False,
    site: str = "block",
    combine: str = "mean",
    weights: Sequence[float] | None = None,
    prompt: str = "",
    overwrite: bool = False,
    **options: Any,
) -> ExportResult:
    """Write layer ``K`` (or a mean or weighted mix of layers up to ``K``) of a model as a directory that transformers
    and sentence-transformers load, check it against layerwise, and return the result.

    The directory holds the model cut after layer ``K`` (config with ``K`` layers, safetensors weights of layers
    ``0..K`` only, the tokenizer) and the sentence-transformers modules that pool it, so
    ``AutoModel.from_pretrained(DIR)`` gives layer ``K``'s states ``[batch, tokens, hidden]`` as
    ``last_hidden_state`` and ``SentenceTransformer(DIR).encode(texts)`` layerwise's vectors ``[n_texts, hidden]``.
    ``site="raw"`` on an architecture with a final norm keeps layer ``K + 1`` too: ``hidden_states[K]`` is then
    layer ``K`` without the norm, and sentence-transformers reads it (``config.json``'s ``layerwise.read`` says
    which state).

    Args:
        output: the directory to write (must not exist, be empty, or hold an earlier export with ``overwrite``).
        model: a :class:`~layerwise.ModelOptions`, a model directory or hub id, or ``None`` for the embedded
            all-MiniLM-L6-v2.
        layers: a layer spec (``3``, ``-1``, ``"-4:"``); several layers are mixed by ``combine``.
        pool: ``mean | cls | max | last``, or ``pooler`` (a BERT-style pooler: ``tanh(dense(cls))``).
        normalize: L2-normalise the vectors (sentence-transformers' ``Normalize`` module).
        site: ``block`` (layer ``K`` as the cut model computes it: an architecture with a final norm runs it after
            layer ``K``) or ``raw`` (layer ``K`` without a final norm: layerwise's own layer ``K``; on an
            architecture with one, a layer below the last, at the cost of one more layer).
        combine: ``mean | sum | weighted`` for several layers (sentence-transformers' ``WeightedLayerPooling``).
        weights: one weight per layer for ``combine="weighted"``.
        prompt: text put before every text (the directory's default prompt).
        overwrite: replace an earlier layerwise export at ``output``.
        options: more :class:`~layerwise.ModelOptions` fields (``revision``, ``trust_remote_code``...).

    Returns:
        :class:`ExportResult`; its report is also written as ``DIR/layerwise-export.json``.

    Raises:
        SpecError: a choice the directory cannot express (naming what can be exported instead).
        ExportError: the output is taken, the disk is too full, or the written directory failed its check (the
            numbers are in the message; nothing is left at the output).
    """
    from ..extractor import Extractor
    from .checkpoint import check_free_space, model_facts, weights_bytes
    from .verify import probe_texts, reference

    out = Path(output).expanduser()
    check_output(out, overwrite)
    opts = _source_options(model, options)
    spec = EncodeSpec(layers=layers, site=site, combine=combine, weights=weights, pool=pool, normalize=normalize,
                      prompt=prompt, truncate=True)
    ex = Extractor.from_options(opts)
    spec = spec.resolve(ex)
    facts = model_facts(ex.loaded, window=ex.max_length)
    if getattr(ex.loaded.model.config, "auto_map", None):
        raise ExportError(f"{ex.loaded.name!r} runs modelling code shipped with it (trust_remote_code); a directory "
                          f"written from it would need that code too, so it cannot be exported as a standard one. "
                          f"Serve its layers with layerwise serve --trust-remote-code instead")
    plan = plan_export(spec, facts)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    size = weights_bytes(ex.loaded.model)
    check_free_space(out.parent, size)
    ref = reference(ex, plan, probe_texts())
    source = {"model": str(ex.loaded.name), "fingerprint": ex.fingerprint(), "architecture": facts.architecture,
              "model_type": facts.model_type, "num_layers": facts.num_layers, "hidden_size": ex.hidden_size}
    built = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(built, ignore_errors=True)
    built.mkdir()
    try:
        report = _write_and_check(ex, plan, facts, source, ref, built)
        _place(built, out, overwrite)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(built)
        raise
    return ExportResult(directory=out, report=report)


def _write_and_check(ex: Extractor, plan: ExportPlan, facts: ModelFacts, source: dict[str, Any], ref: Reference,
                     built: Path) -> dict[str, Any]:
    """Cut ``ex``'s model, write it and the sentence-transformers files into ``built``, check the directory against
    ``ref`` and write ``layerwise-export.json``; return the report (:class:`~layerwise.ExportError` if a check
    failed)."""
    from .checkpoint import check_memory, cut_model, weights_bytes, write_checkpoint
    from .st_modules import write_st_files
    from .verify import check_sentence_transformers, check_transformers

    cut_model(ex.loaded, plan.kept)
    check_memory(weights_bytes(ex.loaded.model))
    dtype = write_checkpoint(ex.loaded, built, _config_record(plan, source))
    pooler: Any = (ex.loaded.model.get_submodule(facts.pooler) if plan.spec.pool == "pooler" and facts.pooler
                   else None)  # an nn.Linear (pooler_linear checked it)
    modules = write_st_files(plan, ex.hidden_size, built, pooler)
    device = ex.loaded.device  # the checks run where the reference ran: the same kernels
    checks = {"transformers": check_transformers(built, plan, ref, facts.model_type, device),
              "sentence_transformers": check_sentence_transformers(built, ref, plan.scale, device)}
    passed = all(c.get("passed", True) for c in checks.values())
    files, size = _files(built)
    report = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "layerwise": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source": source,
        "export": {**plan.to_dict(), "serve_alias": serve_alias(plan),
                   "weights_dtype": str(dtype).removeprefix("torch."),
                   "sentence_transformers_modules": modules, "files": files, "bytes": size},
        "probe": {"texts": len(ref.texts), "sha256": hashlib.sha256("\n".join(ref.texts).encode()).hexdigest()},
        "checks": checks,
        "passed": passed,
    }
    if not passed:
        raise ExportError(_failure(report))
    (built / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


CONFIG_KEYS = ("layers", "layers_kept", "read", "final_norm", "final_norm_after_layer", "final_norm_added",
               "vectors_see_final_norm")  # the plan's fields that config.json repeats


def _config_record(plan: ExportPlan, source: dict[str, Any]) -> dict[str, Any]:
    """What ``config.json`` says under ``"layerwise"``: where the cut came from, which state the vectors read and
    whether the final norm runs."""
    described = plan.to_dict()
    return {"source": source["model"], "source_num_layers": source["num_layers"], "site": plan.spec.site,
            **{key: described[key] for key in CONFIG_KEYS}, "report": REPORT_NAME}


def _failure(report: dict[str, Any]) -> str:
    checks = report["checks"]
    tf, st = checks["transformers"], checks["sentence_transformers"]
    parts = []
    if not tf["passed"]:
        if not tf["ids_equal"]:
            parts.append(f"the written tokenizer gives other token ids than layerwise for {tf['ids_differ_at']}")
        parts.append(f"transformers {tf['class']}: max |diff| {tf['max_abs_diff']:.3e} (bound {tf['bound']:.0e}; "
                     f"per layer {tf['per_layer']})")
    if st.get("checked") and not st["passed"]:
        parts.append(f"sentence-transformers: min cosine {st['min_cosine']:.7f} (bound {st['bound']})")
    return ("the exported directory does not match layerwise on the probe set, so nothing was written: "
            + "; ".join(parts) + ". Please report it with the model and the command")


__all__ = ["ExportResult", "FORMAT", "REPORT_NAME", "check_output", "export_model", "is_export"]
