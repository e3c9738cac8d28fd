"""Probe results: the table (terminal, Markdown, CSV, JSON), the plots (matplotlib) and an HTML report.

An output directory is recognised as a probe's by its ``results.json``: ``"format": "layerwise-probe"`` (the marker)
and ``"files"``, the names the run wrote there (:data:`OUTPUT_FILES`). :func:`check_output` refuses, before any
work, to replace a file of those names that no probe run wrote (even with ``overwrite``), and an earlier probe
output without ``overwrite``; :func:`write_all` replaces only the probe's own files, nothing else in the directory.
"""

from __future__ import annotations

import base64
import csv
import html
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..outputs import OwnedOutput

if TYPE_CHECKING:
    import torch
    from rich.table import Table

    from ..store.rows import StoredRows

FORMAT = "layerwise-probe"  # the marker in results.json
OUTPUT_FILES = ("results.md", "results.csv", "results.json", "layers.png", "similarity.png", "report.html")


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al. 2019) between ``x [n, p]`` and ``y [n, q]``.

    ``||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)``, with ``Xc`` and ``Yc`` centred column by column.
    """
    x = x - x.mean(0, keepdims=True)
    y = y - y.mean(0, keepdims=True)
    cross = np.linalg.norm(y.T @ x) ** 2
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(cross / denom) if denom > 0 else 0.0


def cka_matrix(x: "np.ndarray | torch.Tensor | StoredRows", max_rows: int = 4000, seed: int = 0) -> np.ndarray:
    """``[L + 1, L + 1]`` linear CKA between every pair of layers of ``x [rows, L + 1, W]`` (any float dtype, or rows
    read from a store on demand; only the ``max_rows`` rows sampled are read and widened to float64)."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(x), size=min(max_rows, len(x)), replace=False) if len(x) > max_rows else np.arange(len(x))
    sub = x[rows]  # in its own dtype; each layer widened to float64 when compared
    k = sub.shape[1]
    out = np.eye(k)
    for i in range(k):
        a = np.asarray(sub[:, i], dtype=np.float64)
        for j in range(i + 1, k):
            out[i, j] = out[j, i] = linear_cka(a, np.asarray(sub[:, j], dtype=np.float64))
    return out


def _fmt(mean: float | None, std: float | None, restarts: int, ci: list[float] | None = None) -> str:
    if mean is None:
        return "-"
    return (f"{100 * mean:.2f}" + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")
            + (f" ± {100 * std:.2f}" if restarts > 1 and std else ""))


def table_rows(results) -> list[dict]:
    """One flat dict per probe: name, kind, layers, combine (``-`` for a single layer), dev/test mean, std and
    bootstrap 95% interval of the main metric, the split reported, whether it is inside the noise of the best,
    selectivity (``--control``), weights."""
    rows = []
    for r in results.rows:
        rows.append({
            "probe": r["name"], "kind": r["kind"], "layers": r["layers"],
            "combine": r["combine"] if len(r["layers"]) > 1 else "-",  # one layer: nothing is combined (older runs)
            "dev": r["dev_mean"], "dev_std": r["dev_std"], "dev_ci": r.get("dev_ci"), "test": r.get("test_mean"),
            "test_std": r.get("test_std"), "test_ci": r.get("test_ci"), "reported": r.get("reported", "dev"),
            "within_noise_of_best": r.get("within_noise_of_best"), "selectivity": r.get("selectivity"),
            "dev_accuracy": r["dev_accuracy"], "weights": r.get("weights"),
            "one_hot": one_hot_layer(r),
            "C": (r.get("fits") or [{}])[0].get("C"),  # the linear probe's chosen strength (None otherwise)
            "converged": (r.get("fits") or [{}])[0].get("converged"),
            "mdl": r.get("mdl"),  # the online code (ProbeConfig.mdl; single layers)
        })
    return rows


ONE_HOT = 1e-3  # a learned mix with all but this much of its weight on one layer is flagged as that layer alone


def one_hot_layer(row: dict) -> int | None:
    """The layer a learned mix's row put all its weight on (within :data:`ONE_HOT` of one-hot), else ``None``: such
    a mix is that layer, whatever its name says."""
    weights = row.get("weights")
    if not weights or len(weights) < 2 or max(weights) < 1 - ONE_HOT:
        return None
    return int(row["layers"][int(np.argmax(weights))])


def method_note(results) -> str:
    """How the scores were chosen and what the control is: the strength ``C`` of a linear probe is chosen by
    cross-validated accuracy on the training split (token accuracy for a tagging task, whose table reports entity
    F1), and with ``--control`` on a sentence task, what its control measures there."""
    opts = results.options
    lines = []
    if opts.get("probe") == "linear":
        tagging = results.metric_name != "accuracy"
        lines.append("The linear probes' L2 strength C was chosen by cross-validated "
                     + ("token accuracy" if tagging else "accuracy") + " on the training split"
                     + (f" (the table reports {results.metric_name})" if tagging else "") + ".")
    if opts.get("control") and results.task != "tagging":
        lines.append("Control (sentence task): each distinct text was given a fixed random label; texts rarely "
                     "repeat between splits, so the control scores about chance (the most frequent label's share) "
                     "and selectivity is the score above chance, not a measure of memorisation.")
    uniform = [r["name"] for r in results.rows
               if any((f.get("mix_validation") or {}).get("kept") == "uniform" for f in r.get("fits") or [])]
    if uniform:
        lines.append(f"{_names(uniform)} kept the uniform mix of {'its' if len(uniform) == 1 else 'their'} layers: "
                     "the learned weights scored below it on held-out folds of the training split.")
    flagged = [r["name"] for r in results.rows if one_hot_layer(r) is not None]
    if flagged:
        lines.append(f"{_names(flagged)} put all but {ONE_HOT:g} of {'its' if len(flagged) == 1 else 'their'} "
                     f"weight on one layer (marked 'one-hot' in the table): that layer's score, not a mix's.")
    return " ".join(lines)


def _items(results, split: str) -> str:
    """``" (2,001 sentences, 25,148 words)"``: what a split's score is over (empty when not recorded)."""
    rows = (getattr(results, "provenance", None) or {}).get(f"{split}_rows")
    if rows is None:
        return ""
    if results.task != "tagging":
        return f" ({rows:,} texts)"
    sentences = (getattr(results, "provenance", None) or {}).get(f"{split}_sentences")
    return f" ({sentences:,} sentences, {rows:,} words)" if sentences else f" ({rows:,} words)"


def _linear(results) -> bool:
    return any(r.get("fits") and r["fits"][0].get("C") is not None for r in results.rows)


def _has_mdl(results) -> bool:
    return any(r.get("mdl") for r in results.rows)


def _columns(results) -> tuple[list[str], bool, bool, bool]:
    metric = results.metric_name
    has_test = any(r.get("test_mean") is not None for r in results.rows)
    extra_acc = metric != "accuracy"  # entity F1 tables also show token accuracy
    control = any(r.get("selectivity") is not None for r in results.rows)
    head = (["probe", "layers", "combine", f"dev {metric} [95% CI]{_items(results, 'dev')}"]
            + ([f"test {metric} [95% CI]{_items(results, 'test')}"] if has_test else [])
            + (["dev accuracy"] if extra_acc else []) + (["selectivity"] if control else [])
            + (["C", "converged"] if _linear(results) else [])
            + (["MDL kbits (compression)"] if _has_mdl(results) else [])
            + [f"within noise of best ({'test' if has_test else 'dev'})"])
    return head, has_test, extra_acc, control


def _cells(results, r: dict, has_test: bool, extra_acc: bool, control: bool) -> list[str]:
    combine = r["combine"] + (f" (one-hot: layer {r['one_hot']})" if r.get("one_hot") is not None else "")
    cells = [r["probe"], str(r["layers"]), combine, _fmt(r["dev"], r["dev_std"], results.restarts, r["dev_ci"])]
    if has_test:
        cells.append(_fmt(r["test"], r["test_std"], results.restarts, r["test_ci"]))
    if extra_acc:
        cells.append(f"{100 * r['dev_accuracy']:.2f}")
    if control:
        cells.append("-" if r["selectivity"] is None else f"{100 * r['selectivity']:.2f}")
    if _linear(results):
        cells.append("-" if r.get("C") is None else f"{r['C']:.3g}")
        cells.append({True: "yes", False: "no", None: "-"}[r.get("converged")])
    if _has_mdl(results):
        code = r.get("mdl")
        cells.append("-" if not code else f"{code['kbits']:,.1f} ({code['compression']:.2f}x)")
    cells.append({True: "yes", False: "no", None: "-"}[r["within_noise_of_best"]])
    return cells


def noise_note(results) -> str:
    """One sentence: which probes are inside the noise of the best on the reported split."""
    same = results.within_noise()
    best = results.best["name"]
    others = [n for n in same if n != best]
    split = results.reported
    if not others:
        return (f"On {split}, {best} is ahead of every other probe by more than the noise (paired bootstrap, 95%).")
    return (f"On {split}, {_names(others)} {'is' if len(others) == 1 else 'are'} within the noise of the best, "
            f"{best} (paired bootstrap, 95%: the interval of the difference holds 0); the other differences are "
            f"larger than the noise.")


def markdown(results) -> str:
    """The results table in Markdown: every probe's scores with their bootstrap 95% intervals, the split each
    column comes from in its header."""
    head, has_test, extra_acc, control = _columns(results)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows(results):
        lines.append("| " + " | ".join(_cells(results, r, has_test, extra_acc, control)) + " |")
    return "\n".join(lines)


def _figure(figsize: tuple[float, float]):
    # The object API (no pyplot): draws on its own Agg canvas and leaves the user's backend and pyplot state alone.
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, dpi=120)


def plot_layers(results, path: Path) -> None:
    from matplotlib import rcParams

    split = getattr(results, "reported", "dev")  # the split the scores are reported on
    singles = [r for r in results.rows if r["kind"] == "layer"]
    strategies = [r for r in results.rows if r["kind"] == "strategy" and len(r["layers"]) > 1]
    xs = [r["layers"][0] for r in singles]
    ys = [100 * r[f"{split}_mean"] for r in singles]
    cis = [r.get(f"{split}_ci") or [r[f"{split}_mean"]] * 2 for r in singles]
    fig = _figure((7.5, 4.2))
    ax = fig.subplots()
    yerr = [[y - 100 * c[0] for y, c in zip(ys, cis)], [100 * c[1] - y for y, c in zip(ys, cis)]]
    ax.errorbar(xs, ys, yerr=yerr, marker="o", capsize=3, label="single layer (bootstrap 95% interval)")
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(strategies):
        ax.axhline(100 * r[f"{split}_mean"], ls="--", lw=1, color=colors[(i + 1) % len(colors)], label=r["name"])
    ax.set_xticks(xs, ["emb" if x == 0 else str(x) for x in xs])
    values = [100 * c[0] for c in cis] + [100 * c[1] for c in cis] + [100 * r[f"{split}_mean"] for r in strategies]
    span = max(values) - min(values) or 1.0
    ax.set_ylim(min(values) - 0.08 * span, max(values) + 0.25 * span)  # room for the strategy lines and the legend
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel(f"{split} {results.metric_name} (%)")
    ax.set_title(f"{results.task_title}: probe per layer ({results.options['probe']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path)


def plot_similarity(cka: np.ndarray, path: Path, title: str) -> None:
    k = cka.shape[0]
    fig = _figure((5.2, 4.4))
    ax = fig.subplots()
    im = ax.imshow(cka, vmin=0, vmax=1, cmap="viridis")
    labels = ["emb"] + [str(i) for i in range(1, k)]
    ax.set_xticks(range(k), labels)
    ax.set_yticks(range(k), labels)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{cka[i, j]:.2f}", ha="center", va="center", fontsize=6,
                    color="white" if cka[i, j] < 0.6 else "black")
    ax.set_title(f"linear CKA between layers ({title})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path)


def probe_marker(directory: str | os.PathLike) -> dict | None:
    """The ``results.json`` of ``directory`` when it carries the probe's marker (``"format": "layerwise-probe"``),
    else ``None`` (no, an unreadable, or another program's ``results.json``, or one written before the marker)."""
    try:
        data = json.loads((Path(directory) / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # absent, a directory, not UTF-8, not JSON: not a probe's
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def _names(names: list[str]) -> str:
    return ", ".join(names)


def _listed(directory: Path) -> set[str] | None:
    """The file names ``directory``'s marked ``results.json`` lists as the probe's own (``None``: no marker)."""
    marker = probe_marker(directory)
    if marker is None:
        return None
    listed = marker.get("files")
    return set(listed) if isinstance(listed, list) else set(OUTPUT_FILES)


def owned_output(output: str | os.PathLike) -> OwnedOutput:
    """The probe's result files in ``output`` as an :class:`~layerwise.outputs.OwnedOutput` (``kind="files"``:
    other files of the directory, and ``features/``, are never touched)."""
    return OwnedOutput(
        Path(output), "files", "layerwise probe output", owned=lambda d: _listed(d) is not None,
        marker='results.json with "format": "layerwise-probe", the marker every probe output carries (an output of '
               'a layerwise older than the marker has none either)',
        names=tuple(OUTPUT_FILES), marker_file="results.json", listed=_listed,
        maker="layerwise probe",
    )


def check_output(output: str | os.PathLike, overwrite: bool) -> None:
    """Before any work: refuse an output directory whose result files this run may not replace.

    ``output`` is free when absent or when it holds none of :data:`OUTPUT_FILES` (other files, and ``features/``, the
    feature cache with the store's own rules, are never touched). Files of those names are the probe's own only when
    ``results.json`` carries the marker (``"format": "layerwise-probe"``) and lists them: such an earlier output is
    replaced only with ``overwrite``; any other file of those names is refused, ``overwrite`` or not
    (:meth:`OwnedOutput.check <layerwise.outputs.OwnedOutput.check>`).

    Raises:
        LayerwiseError: naming the files, and the way out (``--overwrite``, another directory, or moving them away).
    """
    owned_output(output).check(overwrite)


def _label(label: str) -> str:
    """A label as written in a note: quoted when it would not read as itself (empty, padded, or with , ( ))."""
    plain = label and label == label.strip() and not any(c in label for c in ",()")
    return label if plain else json.dumps(label, ensure_ascii=False)


def unseen_notes(unseen: Mapping[str, Mapping[str, int]], *, task: str, metric: str,
                 rows: Mapping[str, int | None]) -> list[str]:
    """One sentence per split whose gold labels include some the training data lacks: how many rows, which labels
    (the 10 most frequent), and how the task's metric scores them (``[]`` when there are none)."""
    noun = "word" if task == "tagging" else "record"
    notes = []
    for split, counts in unseen.items():
        if not counts:
            continue
        n, total = sum(counts.values()), rows.get(split)
        them = "it as an error" if n == 1 else "them as errors"
        if metric == "entity F1":
            how = ("entity F1 follows seqeval's rule: a gold entity counts as found only with its exact span and "
                   f"type, so one the probe cannot tag is missed (lower recall), and token accuracy counts {them}")
        else:
            how = (f"a probe cannot predict a label it never saw, so {'token ' if task == 'tagging' else ''}accuracy "
                   f"counts {them}")
        count = f"{n:,} of {total:,} {noun}s" if total else f"{n:,} {noun}{'' if n == 1 else 's'}"
        shown = _names([f"{_label(label)} ({c:,})" for label, c in list(counts.items())[:10]])
        more = f", and {len(counts) - 10} more" if len(counts) > 10 else ""
        notes.append(f"{split}: {count} {'has a label' if n == 1 else 'have labels'} the training data lacks: "
                     f"{shown}{more}; {how}")
    return notes


def write_all(results, out: Path) -> dict[str, Path]:
    """Write :data:`OUTPUT_FILES` (results.md/.csv/.json, layers.png, similarity.png, report.html) into ``out``.

    ``results.json`` carries the marker (``"format": "layerwise-probe"``, ``"files"``). The files are written into a
    temporary directory beside them and moved into place, ``results.json`` first, so a failure leaves an earlier
    output as it was; only these files are replaced, nothing else in ``out`` is touched
    (:class:`~layerwise.outputs.OwnedOutput`). Check ``out`` first with :func:`check_output`: the rule is checked
    again here, as replacing the earlier output that check allowed.
    """
    owned_output(out).write(lambda staged: _write_files(results, staged), overwrite=True)  # checked before the run
    return {name: out / name for name in OUTPUT_FILES}


def _write_files(results, out: Path) -> dict[str, Path]:
    files = {name: out / name for name in OUTPUT_FILES}
    md = markdown(results)
    notes = results.unseen_notes()
    unseen_md = "".join(f"- {note}\n" for note in notes)
    files["results.md"].write_text(
        f"# {results.task_title}\n\n{md}\n\n{noise_note(results)}\n\n"
        + (f"{method_note(results)}\n\n" if method_note(results) else "")
        + (f"**Labels unseen in training:**\n\n{unseen_md}\n" if notes else "")
        + f"{results.provenance_line()}\n",
        encoding="utf-8",
    )
    with open(files["results.csv"], "w", newline="", encoding="utf-8") as fh:
        rows = table_rows(results)
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in r.items()})
    data = {"format": FORMAT, "files": list(OUTPUT_FILES), **results.to_dict()}
    files["results.json"].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    plot_layers(results, files["layers.png"])
    plot_similarity(np.asarray(results.cka), files["similarity.png"], results.task_title)
    imgs = {k: base64.b64encode(files[k].read_bytes()).decode() for k in ("layers.png", "similarity.png")}
    table_html = _md_table_html(md)
    unseen_html = ("<h2>Labels unseen in training</h2><ul>"
                   + "".join(f"<li>{html.escape(note)}</li>" for note in notes) + "</ul>") if notes else ""
    prov = html.escape(json.dumps(results.provenance, indent=2))
    files["report.html"].write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>layerwise probe: {html.escape(results.task_title)}</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
        "</style></head><body>"
        f"<h1>{html.escape(results.task_title)}</h1>{table_html}<p>{html.escape(noise_note(results))}</p>"
        f"<p>{html.escape(method_note(results))}</p>"
        f"{unseen_html}"
        f"<h2>Score per layer</h2><img src='data:image/png;base64,{imgs['layers.png']}'>"
        f"<h2>Similarity between layers</h2><img src='data:image/png;base64,{imgs['similarity.png']}'>"
        f"<h2>Provenance</h2><pre>{prov}</pre></body></html>\n",
        encoding="utf-8",
    )
    return files


def _md_table_html(md: str) -> str:
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    out = ["<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>"]
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        out.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(out) + "</table>"


def terminal_table(results) -> Table:
    """The probe table for the terminal (rich): one row per probe with its dev and test scores."""
    from rich.table import Table
    from rich.text import Text

    notes = results.unseen_notes()  # labels are the user's text: never read as rich markup
    caption = Text("\n".join(f"warning: {n}" for n in notes), style="yellow") if notes else None
    t = Table(title=results.task_title, caption=caption, caption_justify="left")
    head, has_test, extra_acc, control = _columns(results)
    for col in head:
        t.add_column(col, justify="left" if col in ("probe", "layers", "combine") else "right")
    for r in table_rows(results):
        t.add_row(*_cells(results, r, has_test, extra_acc, control))
    return t

