"""``layerwise inspect STORE``: manifest, counts, sizes and a sample of a feature store."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from .options import user_errors


def inspect(
    store: str = typer.Argument(..., help="A store directory written by layerwise extract."),
    sample: int = typer.Option(3, "--sample", help="How many records to show."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON only."),
) -> None:
    """Print a store's provenance, counts, sizes and a few records."""
    from ..store import open_store
    from ..store.activations import is_activation_store

    with user_errors():  # a damaged store is one error line, even when found while reading a record
        if is_activation_store(store):
            _activations(store, as_json)
            return
        _show(open_store(store), store, sample, as_json)


def _activations(store: str, as_json: bool) -> None:
    """``inspect`` of a token-activation store: what it holds, from what, its size and float8's fidelity."""
    from ..store.activations import ActivationStore

    acts = ActivationStore(store)
    m = acts.manifest
    if as_json:
        print(json.dumps(m, indent=2))
        return
    table = Table(title=f"token activations {store}", show_header=False)
    counts = m.get("counts") or {}
    rows = [("status", str(m.get("status"))), ("model", str((m.get("model") or {}).get("name"))),
            ("runtime", _runtime(m)), ("layers", ", ".join(map(str, acts.layers))), ("site", acts.spec.site),
            ("contexts", f"{acts.num_contexts:,} x {acts.context_size} tokens = {acts.num_tokens:,} tokens"),
            ("width, dtype", f"{acts.width}, {acts.dtype}"),
            ("bytes", f"{acts.nbytes:,} in {len(acts.entries)} shards"),
            ("left over, skipped", f"{counts.get('left_over', 0):,} tokens, {counts.get('skipped', 0):,} records"),
            ("input", str((m.get("input") or {}).get("path")))]
    for layer, f in (m.get("fidelity") or {}).items():
        rows.append((f"float8 layer {layer}", f"cosine mean {f['cosine_mean']:.5f}, min {f['cosine_min']:.5f}"))
    for key, value in rows:
        table.add_row(key, value)
    Console().print(table)


def _runtime(manifest: dict[str, Any]) -> str:
    """The runtime that computed the store, its version and why it was chosen (``-`` for a store that predates it)."""
    runtime = manifest.get("runtime")
    if not isinstance(runtime, dict):
        return "- (not recorded)"
    return f"{runtime.get('name')}: {runtime.get('label')} ({runtime.get('why')})"


def _show(st: Any, store: str, sample: int, as_json: bool) -> None:
    if as_json:
        print(json.dumps(st.manifest, indent=2))
        return
    console = Console()
    o, m, src, counts = st.spec, st.model, st.manifest["input"], st.manifest.get("counts") or {}
    table = Table(title=f"layerwise store {store}", show_header=False)
    rows = [
        ("status", st.manifest.get("status")),
        ("model", f"{m['name']} ({m.get('family')}, {m.get('num_layers')} layers) weights "
                  f"{str(m.get('fingerprint'))[:12]}"),
        ("runtime", _runtime(st.manifest)),
        ("layers / site", f"{list(o.layer_indices)} / {o.site}"),
        ("combine", f"{o.combine}" + (f" {list(o.weights)}" if o.weights else "")),
        ("level", o.level + (f", pool {o.pool}" if o.pool else "") + (f", subword {o.subword}" if o.subword else "")),
        ("features", f"{list(st.feature_shape)} {o.output_dtype}"),
        ("input", f"{src.get('path')} ({src.get('format')}) sha256 {_input_hash(src)}"),
        ("kept columns", ", ".join(st.columns) or "-"),
        ("records", f"{len(st)} ({counts.get('skipped', 0)} skipped)"),
        ("rows / tokens", f"{st.num_rows} / {counts.get('tokens', 0)}"),
        ("shards / bytes", f"{st.num_shards} / {st.nbytes:,}"),
        ("layerwise", f"{st.manifest.get('layerwise_version')} (created {st.manifest.get('created')})"),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)
    for i in range(min(sample, len(st))):
        x = np.asarray(st[i], dtype=np.float32)
        extra = ""
        if st.level == "word":
            extra = " words " + " ".join(st.words(i))[:60]
        cols = {c: st.column(c)[i] for c in st.columns}
        console.print(f"record {i} (line {int(st.lines[i])}): shape {list(x.shape)} mean {x.mean():+.4f} "
                      f"norm {np.linalg.norm(x.reshape(-1)):.3f}{extra} {cols if cols else ''}", highlight=False)


def _input_hash(src: dict) -> str:
    """The input's sha256 as shown: a stream's is known once it was read to the end."""
    if src.get("sha256"):
        return str(src["sha256"])[:12] + (f" ({src['bytes']:,} bytes)" if src.get("bytes") is not None else "")
    return "not yet known (stdin: recorded when read to the end)" if src.get("path") == "-" else "-"
