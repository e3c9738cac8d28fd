"""Output precisions (``EncodeSpec.output_dtype``, ``dimensions``, ``calibration``): the values equal
sentence-transformers' ``quantize_embeddings``, the spec refuses what cannot work (naming the valid values and the
fix), and ``encode``, ``extract`` (a binary store is 32x smaller), the CLI and the service (its own API, OpenAI's
and TEI's routes, an alias holding a calibration file) all take them.
"""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest

import layerwise as lw
from layerwise.encoding.precision import calibration_ranges, quantize_array, read_calibration

from tiny import serve_in_thread

TEXTS = ["I love Paris", "EU rejects German call to boycott British lamb", "hello", "stocks fell sharply today",
         "what a wonderful film", "the cat sat on the mat"]


def st_quantize():
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.util.quantization import quantize_embeddings
    except ImportError:  # sentence-transformers before 5
        from sentence_transformers.quantization import quantize_embeddings
    return st, quantize_embeddings


def test_values_equal_sentence_transformers_quantize_embeddings(default_extractor):
    _, quantize_embeddings = st_quantize()
    ex = default_extractor
    f = ex.encode(TEXTS, normalize=True)
    for precision in ("binary", "ubinary"):
        got = ex.encode(TEXTS, normalize=True, output_dtype=precision)
        want = quantize_embeddings(f, precision)
        assert got.dtype == want.dtype and got.shape == (len(TEXTS), 48)
        np.testing.assert_array_equal(got, want)
    spec = ex.calibrate(TEXTS, lw.EncodeSpec(output_dtype="int8", normalize=True))
    ranges = np.array(spec.calibration)
    live = (ranges[1] - ranges[0]) > 1e-6  # all-MiniLM has a dimension that is constant near 0 (no range to split)
    for precision in ("int8", "uint8"):
        got = ex.encode(TEXTS, normalize=True, output_dtype=precision, calibration=spec.calibration)
        want = quantize_embeddings(f, precision, ranges=ranges)
        assert got.dtype == want.dtype == np.dtype(precision)
        # sentence-transformers truncates toward zero, layerwise rounds to the nearest step: at most one apart
        assert np.abs(got[:, live].astype(int) - want[:, live].astype(int)).max() <= 1
    # the calibration set's own extremes land on the ends of the range
    q = ex.encode(TEXTS, normalize=True, output_dtype="int8", calibration=spec.calibration)
    assert q[:, live].min() == -128 and q[:, live].max() == 127


def test_quantize_array_packs_bits_high_first_and_clips_to_the_range():
    x = np.array([[0.5, -1.0, 2.0, 0.0, 1, 1, 1, 1, -3.0]])
    np.testing.assert_array_equal(quantize_array(x, "ubinary"), [[175, 0]])
    np.testing.assert_array_equal(quantize_array(x, "binary"), [[175 - 128, -128]])
    ranges = calibration_ranges(np.array([[0.0, -1.0], [1.0, 1.0]]))
    np.testing.assert_array_equal(quantize_array(np.array([[5.0, -9.0], [0.0, 1.0]]), "uint8", ranges),
                                  [[255, 0], [0, 255]])
    with pytest.raises(lw.SpecError, match="inf or NaN"):
        quantize_array(np.array([[np.nan, 1.0]]), "int8", ranges)


def test_spec_refuses_what_cannot_work(default_extractor):
    ex = default_extractor
    with pytest.raises(lw.SpecError, match="binary, ubinary"):
        lw.EncodeSpec(output_dtype="int4")
    with pytest.raises(lw.SpecError, match=r"needs calibration ranges.*Extractor.calibrate.*--calibration"):
        lw.EncodeSpec(output_dtype="int8").resolve(ex)
    with pytest.raises(lw.SpecError, match="int8 or uint8 only"):
        lw.EncodeSpec(calibration=([0.0], [1.0]))
    with pytest.raises(lw.SpecError, match="value 1 has min 2.0 and max 1.0"):
        lw.EncodeSpec(output_dtype="uint8", calibration=([0.0, 2.0], [1.0, 1.0]))
    with pytest.raises(lw.SpecError, match="equal, non-zero length"):
        lw.EncodeSpec(output_dtype="uint8", calibration={"min": [0.0], "max": [1.0, 2.0]})
    with pytest.raises(lw.SpecError, match="positive int"):
        lw.EncodeSpec(dimensions=0)
    with pytest.raises(lw.SpecError, match=r"dimensions=999 is more than the 384"):
        lw.EncodeSpec(dimensions=999).resolve(ex)
    with pytest.raises(lw.SpecError, match="calibration holds 2 ranges but this spec gives 384"):
        lw.EncodeSpec(output_dtype="int8", calibration=([0.0, 0.0], [1.0, 1.0])).resolve(ex)
    with pytest.raises(lw.SpecError, match="calibrate applies to output_dtype int8 or uint8"):
        ex.calibrate(TEXTS, lw.EncodeSpec(output_dtype="binary"))


def test_shapes_json_round_trip_and_levels(default_extractor):
    ex = default_extractor
    spec = ex.calibrate(TEXTS, lw.EncodeSpec(layers="-2:", combine="stack", output_dtype="uint8", dimensions=100))
    resolved = spec.resolve(ex)
    assert resolved.float_shape(384) == (2, 100) and resolved.feature_shape(384) == (2, 100)
    assert len(spec.calibration[0]) == 200
    assert lw.EncodeSpec.from_json(spec.to_json()) == spec
    binary = lw.EncodeSpec(layers="-2:", combine="stack", output_dtype="binary", dimensions=100).resolve(ex)
    assert binary.feature_shape(384) == (2, 13)  # ceil(100 / 8) bytes a layer
    tokens = [r.features for r in ex.stream(TEXTS[:2], lw.EncodeSpec(level="token", output_dtype="ubinary"))]
    floats = [r.features for r in ex.stream(TEXTS[:2], lw.EncodeSpec(level="token"))]
    for t, f in zip(tokens, floats):
        np.testing.assert_array_equal(t.numpy(), np.packbits(f.numpy() > 0, axis=-1))
    cut = ex.encode(TEXTS, normalize=True, dimensions=32)
    full = ex.encode(TEXTS)[:, :32]
    np.testing.assert_allclose(cut, full / np.linalg.norm(full, axis=1, keepdims=True), atol=1e-6)


def test_binary_store_is_32x_smaller_and_reads_back(default_extractor, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"sentence number {i} is about {w}\n" for i, w in enumerate(TEXTS * 20)))
    stores = {}
    for precision in ("float32", "binary"):
        spec = lw.EncodeSpec(output_dtype=precision, normalize=True)
        lw.extract(corpus, tmp_path / precision, spec, model=default_extractor)
        stores[precision] = lw.open_store(tmp_path / precision)
    f32, binary = stores["float32"].to_numpy(), stores["binary"].to_numpy()
    assert binary.dtype == np.int8 and binary.shape == (120, 48)
    assert f32.nbytes / binary.nbytes == 32
    np.testing.assert_array_equal(binary, (np.packbits(f32 > 0, axis=-1).astype(np.int16) - 128).astype(np.int8))
    assert stores["binary"].verify().problems == []
    # the same command again finds the store complete (the spec, with its precision, is the store's)
    lw.extract(corpus, tmp_path / "binary", lw.EncodeSpec(output_dtype="binary", normalize=True),
               model=default_extractor)
    assert len(lw.open_store(tmp_path / "binary").to_numpy()) == 120


def test_cli_encode_with_calibration_texts_and_ranges(tiny_dirs, tmp_path):
    from typer.testing import CliRunner

    from layerwise.cli.main import app

    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(TEXTS) + "\n")
    cli = ["encode", "I love Paris", "hello", "-q", "--normalize", "--model", str(tiny_dirs["bert"])]
    runner = CliRunner()

    def ok(args: list[str]):
        res = runner.invoke(app, cli + args)
        assert res.exit_code == 0, (res.output, res.exception)
        return res

    doc = json.loads(ok(["--output-dtype", "int8", "--calibration", str(calib)]).stdout)
    assert doc["spec"]["output_dtype"] == "int8" and len(doc["spec"]["calibration"][0]) == len(doc["vectors"][0])
    values = np.array(doc["vectors"])
    assert values.dtype.kind == "i" and values.min() >= -128 and values.max() <= 127
    ranges = tmp_path / "ranges.json"
    ranges.write_text(json.dumps({"min": doc["spec"]["calibration"][0], "max": doc["spec"]["calibration"][1]}))
    again = ok(["--output-dtype", "int8", "--calibration", str(ranges)])
    assert json.loads(again.stdout)["vectors"] == doc["vectors"]
    assert read_calibration(ranges) == tuple(tuple(r) for r in doc["spec"]["calibration"])
    refused = runner.invoke(app, cli + ["--output-dtype", "uint8"])
    assert refused.exit_code == 2 and "--calibration FILE" in refused.output
    wrong = runner.invoke(app, cli + ["--output-dtype", "binary", "--calibration", str(calib)])
    assert wrong.exit_code == 2 and "int8 or uint8" in wrong.output
    arr = np.load(io.BytesIO(ok(["--output-dtype", "ubinary", "--dimensions", "16", "-f", "npy"]).stdout_bytes))
    assert arr.dtype == np.uint8 and arr.shape == (2, 2)


@pytest.fixture(scope="module")
def server(tiny_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision")
    (tmp / "calib.txt").write_text("\n".join(TEXTS) + "\n")
    from layerwise.serve import create_app
    from layerwise.serve.aliases import parse_alias

    aliases = dict(map(parse_alias, [f"q8=output_dtype=int8;calibration={tmp / 'calib.txt'}",
                                     "bits=output_dtype=ubinary"]))  # as --alias gives them
    with serve_in_thread(create_app(lw.Extractor(str(tiny_dirs["bert"]), device="cpu"), aliases=aliases)) as url:
        yield url, tmp / "calib.txt"


def test_service_precisions_through_openai_tei_and_own_api(server, tiny_extractors):
    server, calib = server
    openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
    ex = tiny_extractors["bert"]
    q8 = ex.calibrate(TEXTS, lw.EncodeSpec(output_dtype="int8", normalize=True))
    want = ex.encode(TEXTS[:3], normalize=True, output_dtype="int8", calibration=q8.calibration)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    for fmt in ({}, {"encoding_format": "float"}):  # base64 (the client's default) carries the integers as float32
        got = np.array([d.embedding for d in client.embeddings.create(model="q8", input=TEXTS[:3], **fmt).data])
        assert got.shape == want.shape and np.array_equal(got, np.round(got))  # integer codes
        # the server calibrates and batches in its own process: float noise may tip a value over a rounding
        # boundary, so a code may differ by one step, and only rarely
        assert np.abs(got - want).max() <= 1 and (got == want).mean() >= 0.95, np.abs(got - want).max()
    raw = client.embeddings.with_raw_response.create(model="q8", input=TEXTS[:1])
    header = json.loads(raw.headers["x-layerwise-spec"])
    assert header["output_dtype"] == "int8" and header["calibration"].startswith("sha256:")
    bits = client.embeddings.create(model="bert", input=TEXTS[:3], dimensions=16,
                                    extra_body={"output_dtype": "binary"})
    want_bits = ex.encode(TEXTS[:3], normalize=True, dimensions=16, output_dtype="binary")
    np.testing.assert_array_equal(np.array([d.embedding for d in bits.data]), want_bits)
    body = json.dumps({"inputs": TEXTS[:3], "output_dtype": "ubinary"}).encode()
    req = urllib.request.Request(f"{server}/embed", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:  # TEI's /embed with the extension field
        np.testing.assert_array_equal(json.loads(r.read()), ex.encode(TEXTS[:3], normalize=True,
                                                                       output_dtype="ubinary"))
    own = lw.Client(server).encode(TEXTS[:3], normalize=True, output_dtype="uint8",
                                   calibration=ex.calibrate(TEXTS, lw.EncodeSpec(output_dtype="uint8",
                                                                                normalize=True)).calibration)
    assert own.dtype == np.uint8 and own.shape == want.shape
    packed = lw.Client(server).encode(TEXTS[:3], output_dtype="ubinary")
    np.testing.assert_array_equal(packed, ex.encode(TEXTS[:3], output_dtype="ubinary"))
    with urllib.request.urlopen(f"{server}/v1/model", timeout=60) as r:  # the aliases say their calibration briefly
        assert json.loads(r.read())["aliases"]["q8"]["calibration"] == f"{len(TEXTS)} texts from {calib}"
    with pytest.raises(openai.BadRequestError, match="needs calibration ranges"):
        client.embeddings.create(model="bert", input=TEXTS[:1], extra_body={"output_dtype": "int8"})
