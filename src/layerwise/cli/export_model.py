"""``layerwise export-model MODEL -o DIR --layers K``: a chosen layer written as a model transformers and
sentence-transformers load, checked against layerwise before it is reported."""

from __future__ import annotations

from typing import Optional

import typer

from ..model.options import ModelOptions
from .options import PromptOpt, WeightsOpt, err_console, model_flags, parse_layers, parse_weights, user_errors


def final_norm_note(report: dict) -> str | None:
    """What the vectors are when the cut added the final norm after layer K (``--site block``, K below the last layer
    of an architecture with one): not layerwise's layer K, and how to get that one; ``None`` otherwise."""
    export = report["export"]
    if not export.get("vectors_see_final_norm"):
        return None
    k, norm = export["layers"], export["final_norm"]
    return (f"note: these vectors are layer {k} followed by the final norm {norm!r} (the checks above compare them "
            f"with layerwise's layer {k} with that norm applied: what a {k}-layer model of this architecture "
            f"computes). layerwise encode --layers {k} and Extractor.encode(layers={k}) give layer {k} without the "
            f"norm; for those vectors export --site raw (it keeps layer {k + 1} and reads hidden_states[{k}])")


@model_flags
def export_model(
    source: Optional[str] = typer.Argument(
        None, metavar="MODEL", help="Model directory or hub id (or --model; default: the embedded all-MiniLM-L6-v2)."
    ),
    output: str = typer.Option(..., "--output", "-o", help="The directory to write (new, empty, or an earlier "
                               "export with --overwrite)."),
    layers: str = typer.Option(..., "--layers", "-l", help="The layer K to export (3, -1), or several mixed by "
                               "--combine ('2,3', '-2:')."),
    pool: str = typer.Option("mean", "--pool", "-p", help="mean, cls, max, last (sentence-transformers' Pooling) "
                             "or pooler (BERT-style: cls, then a Dense module)."),
    normalize: bool = typer.Option(False, "--normalize", help="L2-normalise the vectors (a Normalize module)."),
    site: str = typer.Option(
        "block", "--site", help="block (layer K as the cut model computes it: a final norm, where the architecture "
        "has one, runs after it) or raw (without it: layerwise's layer K; with a final norm the directory keeps layer "
        "K+1 and reads hidden_states[K])."),
    combine: str = typer.Option("mean", "--combine", "-c", help="Several layers: mean, sum or weighted (--weights); "
                                "sentence-transformers' WeightedLayerPooling."),
    weights: Optional[str] = WeightsOpt,
    prompt: str = PromptOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an earlier layerwise export at -o (never "
                                   "anything else)."),
    *,
    model_options: ModelOptions,
) -> None:
    """Write layer K of MODEL as a Hugging Face directory that is also a sentence-transformers model, check it
    against layerwise (transformers: states within 1e-5; sentence-transformers: cosine >= 0.99999) and report the
    numbers (also in DIR/layerwise-export.json)."""
    from ..cut import export_model as run_export
    from ..errors import LayerwiseError

    with user_errors():
        if source is not None and model_options.model is not None:
            raise LayerwiseError(f"the model is given twice ({source!r} and --model {model_options.model!r}); "
                                 f"give one")
        options = model_options.replace(model=source) if source is not None else model_options
        result = run_export(output, options, layers=parse_layers(layers), pool=pool, normalize=normalize, site=site,
                            combine=combine, weights=parse_weights(weights), prompt=prompt, overwrite=overwrite)
        err_console.print(result.summary(), highlight=False, soft_wrap=True)
        note = final_norm_note(result.report)
        if note:
            err_console.print(note, highlight=False, soft_wrap=True, markup=False)
        err_console.print(f"load it: SentenceTransformer({str(result.directory)!r}), "
                          f"AutoModel.from_pretrained({str(result.directory)!r}), or layerwise serve --model "
                          f"{result.directory} --alias export='{result.serve_alias}'", highlight=False,
                          soft_wrap=True)
        if result.report["export"]["mix"] is not None:
            err_console.print("its vectors need sentence-transformers' WeightedLayerPooling module: serve it with "
                              "SentenceTransformer, Infinity or layerwise serve, not with a server that pools the last "
                              "state itself (vLLM, TEI)", highlight=False, soft_wrap=True)
