"""``layerwise demo``: encode the bundled sample sentences and print, per layer, shapes and a summary."""

from __future__ import annotations

import time
from importlib import resources

from rich.console import Console
from rich.table import Table

from ..model.options import ModelOptions
from .options import extractor, model_flags, user_errors


def sample_sentences() -> list[str]:
    """The sentences bundled with layerwise (``layerwise/data/samples.txt``)."""
    text = resources.files("layerwise").joinpath("data/samples.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


@model_flags
def demo(*, model_options: ModelOptions) -> None:
    """Encode the bundled sample sentences with every layer and print a per-layer summary."""
    import torch

    console = Console()
    with user_errors():
        t0 = time.perf_counter()
        ex = extractor(model_options)
        load_s = time.perf_counter() - t0
        texts = sample_sentences()
        t0 = time.perf_counter()
        stack = ex.hidden_states(texts, layers="all")
        run_s = time.perf_counter() - t0
    console.print(f"[bold]{ex!r}[/bold]  (loaded in {load_s:.2f}s)")
    console.print(f"{len(texts)} sample sentences, {int(stack.attention_mask.sum())} tokens, "
                  f"all {len(stack)} layers captured in {run_s:.3f}s")
    console.print(f"LayerStack.tensor: {tuple(stack.tensor.shape)} = \\[layers, batch, tokens, hidden]\n")
    mask = stack.attention_mask.bool()
    table = Table(title="Per layer: shape \\[batch, tokens, hidden]; mean token norm; mean |x|; mean cosine between\n"
                        "mean-pooled sentences (padding excluded); mean token cosine to the next layer")
    for col in ("idx", "label", "shape", "token norm", "mean |x|", "sent. cos", "cos next"):
        table.add_column(col, justify="right")
    pooled = []
    for k in range(len(stack.layers)):
        h = stack.tensor[k]
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled.append((h * m).sum(1) / m.sum(1))
    for k, idx in enumerate(stack.layers):
        h = stack.tensor[k]
        tokens = h[mask]
        v = torch.nn.functional.normalize(pooled[k], dim=-1)
        sim = v @ v.T
        n = sim.shape[0]
        off = (sim.sum() - sim.diagonal().sum()) / max(n * (n - 1), 1)
        nxt = "-"
        if k + 1 < len(stack.layers):
            a = torch.nn.functional.normalize(tokens, dim=-1)
            b = torch.nn.functional.normalize(stack.tensor[k + 1][mask], dim=-1)
            nxt = f"{(a * b).sum(-1).mean():.3f}"
        table.add_row(str(idx), stack.labels[k], str(tuple(h.shape)), f"{tokens.norm(dim=-1).mean():.2f}",
                      f"{tokens.abs().mean():.4f}", f"{off:.3f}", nxt)
    if not console.is_terminal:
        # piped or in a CI log rich assumes 80 columns and would break rows (and shapes) across lines: fit the table
        console.width = max(console.width, console.measure(table, options=console.options.update_width(1000)).maximum)
    console.print(table)
    console.print("Layer 0 is the embeddings output; layer -1 the last layer (the Hugging Face hidden_states rule).")
