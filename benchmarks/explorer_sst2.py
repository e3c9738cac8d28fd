"""The explorer on SST-2 dev with the default model: its per-layer numbers and the screenshots of the site.

Run: ``./dev bench explorer_sst2 [--train 2000]``. Needs ``../shared/data/sst2`` (or ``$LAYERWISE_SHARED_DATA``)
and chromium (``./dev setup`` installs it).

1. ``layerwise extract`` SST-2 dev (872 sentences) with every layer of the embedded all-MiniLM-L6-v2 stacked,
   mean-pooled, the label kept: the store the corpus view opens.
2. ``layerwise probe`` (sentence task, linear) trained on the first ``--train`` SST-2 train sentences, scored on dev:
   the directory the probe view opens.
3. The explorer's own per-layer scores on the store (kNN leave-one-out, 5-fold linear probe, silhouette), written to
   ``docs/explorer/sst2_dev_scores.json`` and printed as a table with the best layer.
4. Screenshots of the three views in headless chromium: ``docs/explorer/{corpus,sentence,probe}.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import layerwise as lw
from benchmarks.extract_memory import shared_data
from layerwise.explore import Explorer, corpus_from_store, create_explorer_app

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "explorer"
SENTENCE = "the acting is superb , but the plot is not worth your time ."


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=2000, help="SST-2 train sentences for the probe directory")
    ap.add_argument("--port", type=int, default=8799)
    args = ap.parse_args(argv)
    sst2 = shared_data() / "sst2"
    if not (sst2 / "dev.tsv").is_file():
        sys.exit(f"SST-2 not found under {sst2} (set LAYERWISE_SHARED_DATA)")
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="lw-explorer-"))
    ex = lw.Extractor()
    t0 = time.perf_counter()
    lw.extract(sst2 / "dev.tsv", tmp / "store", lw.EncodeSpec(layers="all", combine="stack", pool="mean"), model=ex,
               reading=lw.ReadOptions(keep=("label",)), options=lw.ExtractOptions(progress=False))
    lines = (sst2 / "train.tsv").read_text(encoding="utf-8").splitlines()
    (tmp / "train.tsv").write_text("\n".join(lines[: args.train + 1]) + "\n", encoding="utf-8")
    lw.probe.run(tmp / "train.tsv", sst2 / "dev.tsv", config=lw.probe.ProbeConfig(task="sentence", layers_only=True),
                 model=ex, output=tmp / "probe", log=lambda line: None, progress=False)
    explorer = Explorer(corpus=corpus_from_store(tmp / "store", labels="label"), extractor=ex,
                        probe_dirs=[str(tmp / "probe")])
    scores = explorer.scores()
    seconds = time.perf_counter() - t0
    best = max(range(len(scores["names"])), key=lambda k: scores["probe"][k])
    best_sil = max(range(len(scores["names"])), key=lambda k: scores["silhouette"][k])
    best_knn = max(range(len(scores["names"])), key=lambda k: scores["knn"][k])
    record = {"model": ex.loaded.name, "data": "SST-2 dev (872 sentences), labels 0/1", "scores": scores,
              "best": {"probe": scores["names"][best], "knn": scores["names"][best_knn],
                       "silhouette": scores["names"][best_sil]},
              "date": time.strftime("%Y-%m-%d"), "seconds": round(seconds, 1)}
    (OUT / "sst2_dev_scores.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print("| layer | kNN accuracy | linear probe accuracy | silhouette |\n|---|---|---|---|")
    for k, name in enumerate(scores["names"]):
        print(f"| {name} | {scores['knn'][k]:.3f} | {scores['probe'][k]:.3f} | {scores['silhouette'][k]:.3f} |")
    print(f"best: probe {record['best']['probe']}, kNN {record['best']['knn']}, silhouette "
          f"{record['best']['silhouette']} ({seconds:.0f} s)")
    screenshots(explorer, args.port)
    shutil.rmtree(tmp, ignore_errors=True)


def screenshots(explorer: Explorer, port: int) -> None:
    import uvicorn
    from playwright.sync_api import sync_playwright

    server = uvicorn.Server(uvicorn.Config(create_explorer_app(explorer), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.1)
    base = f"http://127.0.0.1:{port}"
    exe = next(p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        pg = browser.new_page(viewport={"width": 1100, "height": 820})
        pg.goto(base + "/")
        pg.wait_for_selector("body[data-ready='1']", timeout=120_000)
        pg.screenshot(path=str(OUT / "corpus.png"))
        pg.click("#tab-sentence")
        pg.fill("#sentence-input", SENTENCE)
        pg.select_option("#metric", "change")
        pg.click("#sentence-go")
        pg.wait_for_selector("body[data-sentence-shown='1']")
        pg.screenshot(path=str(OUT / "sentence.png"), full_page=True)
        pg.click("#tab-probe")
        pg.wait_for_selector("body[data-probe-shown='1']")
        pg.screenshot(path=str(OUT / "probe.png"), full_page=True)
        browser.close()
    server.should_exit = True
    thread.join(timeout=10)
    print(f"screenshots: {', '.join(str(OUT / n) for n in ('corpus.png', 'sentence.png', 'probe.png'))}")


if __name__ == "__main__":
    main()
