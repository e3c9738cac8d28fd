"""The explorer page in a real headless browser (Debian's chromium driven by Playwright), served by
``layerwise explore`` in a subprocess: corpus view and layer slider, sentence heatmap, probe directory; no request
leaves 127.0.0.1. Screenshots of each view go to the test's temporary directory.

Locally the test is skipped (with the reason) when no chromium is installed; in CI (``LAYERWISE_CI=1``, set by
``.ci/run``) a missing browser is a failure: ``./dev setup`` installs it.
"""

from __future__ import annotations

import os
import shutil

import pytest

import layerwise as lw

from tiny import cli_server, extract, toy

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def browser_path() -> str:
    found = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if found is None or not _has_playwright():
        why = "no chromium on PATH (./dev setup installs it: apt-get install chromium)" if found is None else \
            "playwright is not installed (pip install -e '.[test]')"
        if os.environ.get("LAYERWISE_CI"):
            pytest.fail(f"the browser tests must run in CI: {why}")
        pytest.skip(why)
    return found


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


def exploring(log_path, *args: str):
    """``layerwise explore ARGS`` on a free local port; yields the base URL once the API answers."""
    return cli_server(["explore", *args], log_path, "/explorer/api/info")


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_dirs, tiny_extractors):
    """A labelled store with every layer stacked, a probe directory, and the explorer serving both."""
    root = tmp_path_factory.mktemp("explore-page")
    toy(root / "toy.tsv", 80, seed=2)
    ex = tiny_extractors["bert"]
    extract(root / "toy.tsv", root / "store", model=ex, layers="all", combine="stack", keep=["label"], progress=False)
    probe_dir = root / "probe"
    lw.probe.run(root / "toy.tsv", root / "toy.tsv", config=lw.probe.ProbeConfig(task="sentence", epochs=2),
                 model=ex, output=probe_dir, log=lambda line: None, progress=False)
    with exploring(root / "server.log", str(root / "store"), "--labels", "label", "--model",
                   str(tiny_dirs["bert"]), "--probe", str(probe_dir)) as base:
        yield base, probe_dir


@pytest.fixture()
def page(site):
    from playwright.sync_api import sync_playwright

    exe = browser_path()
    base, _ = site
    requests: list[str] = []
    blocked: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})

        def only_local(route):
            url = route.request.url
            if url.startswith(base + "/"):
                route.continue_()
            else:
                blocked.append(url)
                route.abort()

        context.route("**/*", only_local)
        pg = context.new_page()
        pg.on("request", lambda r: requests.append(r.url))
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(base + "/")
        pg.wait_for_selector("body[data-ready='1']", timeout=60_000)
        yield pg
        assert not errors, errors
        assert requests and all(u.startswith(base + "/") for u in requests), requests
        assert not blocked, f"the page asked for other hosts: {blocked}"
        browser.close()


def _scores(pg) -> tuple[str, str, str]:
    return tuple(pg.inner_text(f"#score-{k}") for k in ("knn", "probe", "silhouette"))  # type: ignore[return-value]


def _points(pg) -> list[tuple[str, str]]:
    return pg.eval_on_selector_all("#scatter circle", "cs => cs.map(c => [c.getAttribute('cx'), c.getAttribute('cy')])")


def test_corpus_view_and_layer_slider(page, tmp_path):
    pg = page
    assert pg.inner_text("#layer-name") == "layer 2"  # opens at the last layer
    assert "all 80 records" in pg.inner_text("#corpus-note")
    last_points, last_scores = _points(pg), _scores(pg)
    assert len(last_points) == 80 and all(s != "-" for s in last_scores)
    colours = set(pg.eval_on_selector_all("#scatter circle", "cs => cs.map(c => c.getAttribute('fill'))"))
    assert len(colours) == 2  # one per label
    pg.wait_for_selector("#score-curve polyline.series", state="attached")
    pg.screenshot(path=str(tmp_path / "corpus.png"), full_page=True)
    pg.eval_on_selector("#layer-slider", "e => { e.value = 0; e.dispatchEvent(new Event('input')); }")
    pg.wait_for_selector("body[data-layer-shown='0']")
    assert pg.inner_text("#layer-name") == "embeddings"
    assert _points(pg) != last_points and _scores(pg) != last_scores  # the picture and the numbers follow
    pg.hover("#scatter circle >> nth=0", force=True)  # (another point may lie on top of it: hover it anyway)
    tip = pg.inner_text("#tooltip")
    assert tip.startswith("[pos] ") or tip.startswith("[neg] ")
    assert (tmp_path / "corpus.png").stat().st_size > 10_000


def test_sentence_view_heatmap(page, tmp_path):
    pg = page
    pg.click("#tab-sentence")
    pg.fill("#sentence-input", "peter blackburn went to brussels")
    pg.click("#sentence-go")
    pg.wait_for_selector("body[data-sentence-shown='1']")
    n_tokens = pg.eval_on_selector_all("#heatmap rect.cell[data-layer='0']", "cs => cs.length")
    assert n_tokens >= 7  # [CLS] + 5 words (some split) + [SEP]
    assert pg.eval_on_selector_all("#heatmap rect.cell", "cs => cs.length") == n_tokens * 3  # tokens x layers 0..2
    assert pg.eval_on_selector_all("#similarity rect.cell", "cs => cs.length") == n_tokens**2
    pg.screenshot(path=str(tmp_path / "sentence.png"), full_page=True)
    pg.select_option("#site", "attention")
    pg.evaluate("document.body.dataset.sentenceShown = ''")
    pg.click("#sentence-go")
    pg.wait_for_selector("body[data-sentence-shown='1']")
    assert pg.eval_on_selector_all("#heatmap rect.cell", "cs => cs.length") == n_tokens * 2  # layers 1..2
    pg.fill("#sentence-input", "")
    pg.click("#sentence-go")
    pg.wait_for_selector("#sentence-error:not([hidden])")
    assert "the text is empty" in pg.inner_text("#sentence-error")


def test_probe_view(page, site, tmp_path):
    import json
    import urllib.error
    import urllib.request

    pg = page
    base, probe_dir = site
    for wrong in ("/explorer/api/probe?path=" + str(probe_dir), "/explorer/api/probe/1", "/explorer/api/probe/-1"):
        with pytest.raises(urllib.error.HTTPError) as info:  # clients never send paths; only the named directories
            urllib.request.urlopen(base + wrong)
        assert info.value.code in (404, 422), wrong
    named = json.loads(urllib.request.urlopen(base + "/explorer/api/probe/0").read())
    assert named["name"] == probe_dir.name and "path" not in named  # no absolute path of the directory
    pg.click("#tab-probe")
    pg.wait_for_selector("body[data-probe-shown='1']")
    results = lw.explore.read_probe_dir(probe_dir)
    assert pg.eval_on_selector_all("#probe-table tr.probe-row", "rs => rs.length") == len(results["rows"])
    assert pg.eval_on_selector_all("#probe-curve .point", "cs => cs.length") == 3  # layers 0..2
    assert pg.eval_on_selector_all("#probe-cka rect.cell", "cs => cs.length") == 9
    pg.screenshot(path=str(tmp_path / "probe.png"), full_page=True)


def test_an_exported_page_opens_from_disk_with_no_request(site, tmp_path, tiny_dirs):
    """``layerwise explore STORE --export page.html``: one file, data included, opened from disk in chromium: the
    corpus view draws every point, the probe view opens, the sentence view says it needs the model, nothing is
    requested from anywhere, and a text or label holding ``</script>`` stays text."""
    import json

    from playwright.sync_api import sync_playwright
    from typer.testing import CliRunner

    from layerwise.cli.main import app

    exe = browser_path()
    _, probe_dir = site
    root = probe_dir.parent
    hostile = tmp_path / "hostile.jsonl"
    rows = [{"text": f"</script><script>window.pwned = 1</script> good {i}", "label": "<b>pos</b>"} for i in range(10)]
    rows += [{"text": f"plain bad words {i}", "label": "neg"} for i in range(10)]
    hostile.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    extract(hostile, tmp_path / "hostile-store", model=lw.Extractor(str(tiny_dirs["bert"]), device="cpu"),
            layers="all", combine="stack", keep=["label"], progress=False)
    runner = CliRunner()
    for store, page in ((root / "store", tmp_path / "page.html"), (tmp_path / "hostile-store", tmp_path / "h.html")):
        res = runner.invoke(app, ["explore", str(store), "--labels", "label", "--model", str(tiny_dirs["bert"]),
                                  "--probe", str(probe_dir), "--export", str(page)])
        assert res.exit_code == 0, res.output
    again = runner.invoke(app, ["explore", str(root / "store"), "--export", str(tmp_path / "page.html")])
    assert again.exit_code == 2 and "holds an earlier layerwise explorer page; pass --overwrite" in again.stderr
    (tmp_path / "mine.html").write_text("<p>my notes</p>")  # a file layerwise did not write: never replaced
    mine = runner.invoke(app, ["explore", str(root / "store"), "--export", str(tmp_path / "mine.html"), "--overwrite"])
    assert mine.exit_code == 2 and "is not a layerwise explorer page" in mine.stderr
    assert (tmp_path / "mine.html").read_text() == "<p>my notes</p>"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        requests: list[str] = []
        context.route("**/*", lambda route: (requests.append(route.request.url), route.abort()
                                             if not route.request.url.startswith("file://") else route.continue_()))
        errors: list[str] = []
        pg = context.new_page()
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto((tmp_path / "page.html").as_uri())
        pg.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert len(_points(pg)) == 80 and all(s != "-" for s in _scores(pg))
        pg.eval_on_selector("#layer-slider", "e => { e.value = 0; e.dispatchEvent(new Event('input')); }")
        pg.wait_for_selector("body[data-layer-shown='0']")
        pg.click("#tab-probe")
        pg.wait_for_selector("body[data-probe-shown='1']")
        pg.click("#tab-sentence")
        pg.fill("#sentence-input", "peter went to brussels")
        pg.click("#sentence-go")
        pg.wait_for_selector("#sentence-error:not([hidden])")
        assert "exported without its model" in pg.inner_text("#sentence-error")
        pg.goto((tmp_path / "h.html").as_uri())
        pg.wait_for_selector("body[data-ready='1']", timeout=60_000)
        assert len(_points(pg)) == 20 and pg.evaluate("window.pwned") is None
        assert pg.evaluate("document.scripts.length") == 2  # the data and the explorer: nothing injected
        texts = pg.evaluate("state.info.corpus.texts")
        assert sum("</script><script>window.pwned = 1</script>" in t for t in texts) == 10  # a string, as written
        assert "<b>pos</b>" in pg.inner_text("#legend")  # a label shown as text
        browser.close()
    assert not errors, errors
    assert requests and all(u.startswith("file://") for u in requests), requests
