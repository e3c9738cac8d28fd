"""Probe results: the table (terminal, Markdown, CSV, JSON), the plots (matplotlib) and an HTML report."""

from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rich.table import Table


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA (Kornblith et al. 2019) between ``x [n, p]`` and ``y [n, q]``.

    ``||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)``, with ``Xc`` and ``Yc`` centred column by column.
    """
    x = x - x.mean(0, keepdims=True)
    y = y - y.mean(0, keepdims=True)
    cross = np.linalg.norm(y.T @ x) ** 2
    denom = np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)
    return float(cross / denom) if denom > 0 else 0.0


def cka_matrix(x: np.ndarray, max_rows: int = 4000, seed: int = 0) -> np.ndarray:
    """``[L + 1, L + 1]`` linear CKA between every pair of layers of ``x [rows, L + 1, W]`` (rows subsampled)."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(x), size=min(max_rows, len(x)), replace=False) if len(x) > max_rows else np.arange(len(x))
    sub = np.asarray(x[rows], dtype=np.float64)
    k = sub.shape[1]
    out = np.eye(k)
    for i in range(k):
        for j in range(i + 1, k):
            out[i, j] = out[j, i] = linear_cka(sub[:, i], sub[:, j])
    return out


def _fmt(mean: float | None, std: float | None, restarts: int) -> str:
    if mean is None:
        return "-"
    return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if restarts > 1 and std is not None else "")


def table_rows(results) -> list[dict]:
    """One flat dict per probe: name, kind, layers, combine, dev/test mean and std of the main metric, weights."""
    rows = []
    for r in results.rows:
        rows.append({
            "probe": r["name"], "kind": r["kind"], "layers": r["layers"], "combine": r["combine"],
            "dev": r["dev_mean"], "dev_std": r["dev_std"], "test": r.get("test_mean"), "test_std": r.get("test_std"),
            "dev_accuracy": r["dev_accuracy"], "weights": r.get("weights"),
        })
    return rows


def markdown(results) -> str:
    metric = results.metric_name
    has_test = any(r.get("test_mean") is not None for r in results.rows)
    extra_acc = metric != "accuracy"  # entity F1 tables also show token accuracy
    head = ["probe", "layers", "combine", f"dev {metric}"] + ([f"test {metric}"] if has_test else []) + (
        ["dev accuracy"] if extra_acc else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows(results):
        cells = [r["probe"], str(r["layers"]), r["combine"], _fmt(r["dev"], r["dev_std"], results.restarts)]
        if has_test:
            cells.append(_fmt(r["test"], r["test_std"], results.restarts))
        if extra_acc:
            cells.append(f"{100 * r['dev_accuracy']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _figure(figsize: tuple[float, float]):
    # The object API (no pyplot): draws on its own Agg canvas and leaves the user's backend and pyplot state alone.
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, dpi=120)


def plot_layers(results, path: Path) -> None:
    from matplotlib import rcParams

    singles = [r for r in results.rows if r["kind"] == "layer"]
    strategies = [r for r in results.rows if r["kind"] == "strategy" and len(r["layers"]) > 1]
    xs = [r["layers"][0] for r in singles]
    ys = [100 * r["dev_mean"] for r in singles]
    fig = _figure((7.5, 4.2))
    ax = fig.subplots()
    ax.errorbar(xs, ys, yerr=[100 * r["dev_std"] for r in singles], marker="o", capsize=3, label="single layer")
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(strategies):
        ax.axhline(100 * r["dev_mean"], ls="--", lw=1, color=colors[(i + 1) % len(colors)], label=r["name"])
    ax.set_xticks(xs, ["emb" if x == 0 else str(x) for x in xs])
    values = ys + [100 * r["dev_mean"] for r in strategies]
    span = max(values) - min(values) or 1.0
    ax.set_ylim(min(values) - 0.08 * span, max(values) + 0.25 * span)  # room for the strategy lines and the legend
    ax.set_xlabel("layer (0 = embeddings)")
    ax.set_ylabel(f"dev {results.metric_name} (%)")
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


def write_all(results, out: Path) -> dict[str, Path]:
    """Write results.md/.csv/.json, layers.png, similarity.png and report.html into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = {name: out / name for name in
             ("results.md", "results.csv", "results.json", "layers.png", "similarity.png", "report.html")}
    md = markdown(results)
    files["results.md"].write_text(f"# {results.task_title}\n\n{md}\n\n{results.provenance_line()}\n", encoding="utf-8")
    with open(files["results.csv"], "w", newline="", encoding="utf-8") as fh:
        rows = table_rows(results)
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, tuple)) else v for k, v in r.items()})
    files["results.json"].write_text(json.dumps(results.to_dict(), indent=2) + "\n", encoding="utf-8")
    plot_layers(results, files["layers.png"])
    plot_similarity(np.asarray(results.cka), files["similarity.png"], results.task_title)
    imgs = {k: base64.b64encode(files[k].read_bytes()).decode() for k in ("layers.png", "similarity.png")}
    table_html = _md_table_html(md)
    prov = html.escape(json.dumps(results.provenance, indent=2))
    files["report.html"].write_text(
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>layerwise probe: {html.escape(results.task_title)}</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
        "</style></head><body>"
        f"<h1>{html.escape(results.task_title)}</h1>{table_html}"
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

    t = Table(title=results.task_title)
    for col in ("probe", "layers", "combine", f"dev {results.metric_name}", f"test {results.metric_name}"):
        t.add_column(col, justify="right" if col.startswith(("dev", "test")) else "left")
    for r in table_rows(results):
        t.add_row(r["probe"], str(r["layers"]), r["combine"], _fmt(r["dev"], r["dev_std"], results.restarts),
                  _fmt(r["test"], r["test_std"], results.restarts))
    return t

