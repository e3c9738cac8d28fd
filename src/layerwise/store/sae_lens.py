"""One layer of a token-activation store written as SAELens's cached activations, so its trainer runs from it unchanged
(``layerwise export ACTS --to sae-lens --layer 8``). Needs ``datasets`` (``pip install 'layerwise[hf]'``).

SAELens (``sae_lens.training.activations_store.ActivationsStore``, ``use_cached_activations=True``) reads a Hugging
Face dataset saved with ``save_to_disk``: one column named after the hook, ``Array2D(shape=(context_size, d_in))``,
and ``token_ids``, ``Sequence(int32, length=context_size)``; one row per context. That is what this writes, context by
context in store order (SAELens shuffles its buffer as it trains), a shard at a time: memory holds one shard's layer.

The hook name is TransformerLens's name of the stored site: layer ``K`` at the ``block`` site is the residual stream
after block ``K - 1``, ``blocks.{K-1}.hook_resid_post`` (layer 0: ``blocks.0.hook_resid_pre``); ``attention`` is
``blocks.{K-1}.hook_attn_out``, ``intermediate`` ``blocks.{K-1}.mlp.hook_post``. Give ``hook_name`` for another
name. (A decoder's last ``hidden_states`` has the final norm applied; TransformerLens's last ``hook_resid_post`` has
not: export the ``raw`` site for the last layer's residual stream without it.)

Values are written as float32 (``dtype="float16"`` halves the size; Arrow has no bfloat16): SAELens casts them to
its ``dtype`` as it reads.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError
from ..extras import require
from ..outputs import OwnedOutput
from .activations import ActivationStore
from .token_loader import decode

MARKER = "layerwise-export.json"
EXPORT_DTYPES = ("float32", "float16")
CONTEXTS_PER_WRITE = 64


def hook_name(layer: int, site: str) -> str:
    """TransformerLens's hook name of ``layer`` (``hidden_states`` numbering) at ``site`` (see the module docstring).

    Raises:
        StoreError: a site without a TransformerLens name (give ``hook_name``).
    """
    if site in ("block", "raw"):
        return "blocks.0.hook_resid_pre" if layer == 0 else f"blocks.{layer - 1}.hook_resid_post"
    if site == "attention" and layer > 0:
        return f"blocks.{layer - 1}.hook_attn_out"
    if site == "intermediate" and layer > 0:
        return f"blocks.{layer - 1}.mlp.hook_post"
    raise StoreError(f"layer {layer} at site {site!r} has no TransformerLens hook name here: give one "
                     f"(--hook-name blocks.N.hook_...)")


def _owned(path: Path) -> bool:
    try:
        return json.loads((path / MARKER).read_text(encoding="utf-8")).get("to") == "sae-lens"
    except (OSError, ValueError, AttributeError):
        return False


def export_sae_lens(store: ActivationStore | str | os.PathLike, out: str | os.PathLike, *, layer: int = -1,
                    hook: str | None = None, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write ``layer`` of a token-activation store to ``out`` as SAELens's cached activations (module docstring);
    returns ``out``. Every shard's sha256 is checked first.

    Then, in SAELens: ``LanguageModelSAERunnerConfig(..., hook_name=HOOK, context_size=N, d_in=W,
    use_cached_activations=True, cached_activations_path=OUT)``.

    Raises:
        StoreError: a layer the store lacks, a dtype not in ``float32 | float16``, an output layerwise did not write
            (or an earlier export without ``overwrite``), a damaged store.
        MissingExtraError: ``datasets`` is not installed.
    """
    if dtype not in EXPORT_DTYPES:
        raise StoreError(f"dtype {dtype!r} is not one of {', '.join(EXPORT_DTYPES)} (Arrow has no bfloat16)")
    datasets = require("datasets", what="the SAELens export (a Hugging Face dataset on disk)", extra="hf")
    acts = store if isinstance(store, ActivationStore) else ActivationStore(store)
    k = acts.check_layer(layer)
    name = hook or hook_name(k, acts.spec.site)
    problems = acts.verify()
    if problems:
        raise StoreError(f"store {str(acts.path)!r} is damaged ({'; '.join(problems)}): rerun the extract command to "
                         f"recompute it before exporting")
    n, width = acts.context_size, acts.width
    features = datasets.Features({name: datasets.Array2D(shape=(n, width), dtype=dtype),
                                  "token_ids": datasets.Sequence(datasets.Value("int32"), length=n)})
    owned = OwnedOutput(Path(out), "directory", "layerwise SAELens export", owned=_owned,
                        marker=f"{MARKER} of a layerwise export", error=StoreError)

    def write(staged: Path) -> None:
        from datasets.arrow_writer import ArrowWriter

        scratch = Path(tempfile.mkdtemp(prefix=".layerwise-sae-", dir=staged.parent))
        try:
            arrow = scratch / "data.arrow"
            with ArrowWriter(features=features, path=str(arrow)) as writer:
                for s in acts.iter_shards():
                    f = acts.shard(s)
                    values, scale = acts.layer_arrays(k)[s]
                    ids = f.array("token_ids")
                    for lo in range(0, ids.shape[0], CONTEXTS_PER_WRITE):
                        hi = min(lo + CONTEXTS_PER_WRITE, ids.shape[0])
                        rows = decode(values[lo * n : hi * n], None if scale is None else scale[lo * n : hi * n],
                                      acts.dtype)
                        writer.write_batch({name: rows.reshape(hi - lo, n, width).astype(dtype, copy=False),
                                            "token_ids": np.asarray(ids[lo:hi], dtype=np.int32)})
                writer.finalize()
            was_on = datasets.utils.logging.is_progress_bar_enabled()
            datasets.utils.logging.disable_progress_bar()  # its bar is not layerwise's to show
            try:
                datasets.Dataset.from_file(str(arrow)).save_to_disk(str(staged))
            finally:
                if was_on:
                    datasets.utils.logging.enable_progress_bar()
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        (staged / MARKER).write_text(json.dumps({
            "to": "sae-lens", "store": str(acts.path), "store_id": acts.manifest.get("id"), "layer": k,
            "site": acts.spec.site, "hook_name": name, "context_size": n, "d_in": width, "dtype": dtype,
            "contexts": acts.num_contexts, "model": acts.manifest.get("model", {}).get("name")}, indent=2),
            encoding="utf-8")

    return owned.write(write, overwrite=overwrite)


def sae_lens_config(out: str | os.PathLike) -> dict[str, Any]:
    """What an export at ``out`` says SAELens needs: ``hook_name``, ``context_size``, ``d_in`` (and the rest of its
    marker)."""
    return json.loads((Path(out) / MARKER).read_text(encoding="utf-8"))


__all__ = ["EXPORT_DTYPES", "export_sae_lens", "hook_name", "sae_lens_config"]
