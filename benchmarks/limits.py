"""The machine's real matrix-product limits, per precision, with the fastest kernels this environment has.

Run alone: ``./dev bench limits [--tokens 1024,4096] [--hidden 384 --ffn 1536]``; ``benchmarks/run.py`` uses
:func:`measure` to put each contestant against the limit of its own precision.

A limit is the best rate (FLOP/s, 2*m*k*n per product) over the encoder's own matrix shapes (``tokens x hidden``
times ``hidden x hidden``, ``hidden x ffn`` and ``ffn x hidden``) plus a 2048 square, through every library that
offers the precision:

* float32: torch (oneDNN/MKL) and ONNX Runtime's MLAS (a one-node ``MatMul`` graph)
* bfloat16: torch (oneDNN; only where the CPU has AVX-512 BF16 or AMX: elsewhere it is emulated, see
  :mod:`layerwise.model.hardware`)
* int8: ONNX Runtime's ``MatMulInteger`` (uint8 x int8 -> int32, VNNI where the CPU has it), the kernel its dynamic
  quantisation runs; activations are already quantised here, so the limit leaves out the quantise step that a real
  int8 model pays

A model does strictly more than its matrix products (softmax, LayerNorm, GELU, copies), so a share of the limit
above 100% means the limit was measured wrong; ``run.py`` says so instead of printing it.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch


def _best(fn: Callable[[], object], repeats: int) -> float:
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def torch_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in torch at ``dtype`` with the current thread count."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    with torch.inference_mode():
        return 2 * m * k * n / _best(lambda: a @ b, repeats)


def _ort_session(m_k: tuple[int, int], weight: np.ndarray, integer: bool, threads: int):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    k = m_k[1]
    a_type = TensorProto.UINT8 if integer else TensorProto.FLOAT
    out_type = TensorProto.INT32 if integer else TensorProto.FLOAT
    node = helper.make_node("MatMulInteger" if integer else "MatMul", ["a", "w"], ["y"])
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("a", a_type, ["m", k])],
                              [helper.make_tensor_value_info("y", out_type, ["m", weight.shape[1]])],
                              [numpy_helper.from_array(weight, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def ort_rate(m: int, k: int, n: int, integer: bool = False, repeats: int = 5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in ONNX Runtime: float32 ``MatMul`` (MLAS) or ``MatMulInteger`` (u8 x s8)."""
    rng = np.random.default_rng(0)
    if integer:
        a = rng.integers(0, 255, size=(m, k), dtype=np.uint8)
        w = rng.integers(-127, 127, size=(k, n), dtype=np.int8)
    else:
        a = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
    sess = _ort_session((m, k), w, integer, torch.get_num_threads())
    return 2 * m * k * n / _best(lambda: sess.run(None, {"a": a}), repeats)


def shapes(hidden: int, ffn: int, tokens: tuple[int, ...] = (1024, 4096)) -> list[tuple[int, int, int]]:
    """The encoder's own products for each token count, plus a 2048 square."""
    out = [(t, hidden, n) for t in tokens for n in (hidden, ffn)] + [(t, ffn, hidden) for t in tokens]
    return out + [(2048, 2048, 2048)]


def measure(hidden: int, ffn: int, tokens: tuple[int, ...] = (1024, 4096), bf16: bool = True) -> dict[str, dict]:
    """``{precision: {"flops": best FLOP/s, "by": "library m x k x n", "all": {library: best}}}``."""
    kernels: dict[str, dict[str, Callable[[int, int, int], float]]] = {
        "float32": {"torch": lambda m, k, n: torch_rate(m, k, n, torch.float32),
                    "onnxruntime": lambda m, k, n: ort_rate(m, k, n)},
        "int8": {"onnxruntime": lambda m, k, n: ort_rate(m, k, n, integer=True)},
    }
    if bf16:
        kernels["bfloat16"] = {"torch": lambda m, k, n: torch_rate(m, k, n, torch.bfloat16)}
    result: dict[str, dict] = {}
    for precision, libs in kernels.items():
        best, by, per_lib = 0.0, "", {}
        for lib, fn in libs.items():
            lib_best = 0.0
            for m, k, n in shapes(hidden, ffn, tokens):
                rate = fn(m, k, n)
                lib_best = max(lib_best, rate)
                if rate > best:
                    best, by = rate, f"{lib} {m}x{k}x{n}"
            per_lib[lib] = lib_best
        result[precision] = {"flops": best, "by": by, "all": per_lib}
    return result


def main(argv=None) -> None:
    from layerwise.model.hardware import native_on_cpu

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--tokens", default="1024,4096")
    args = ap.parse_args(argv)
    tokens = tuple(int(t) for t in args.tokens.split(","))
    res = measure(args.hidden, args.ffn, tokens, bf16=native_on_cpu(torch.bfloat16))
    print(f"{torch.get_num_threads()} threads; shapes {shapes(args.hidden, args.ffn, tokens)}")
    for precision, r in res.items():
        libs = ", ".join(f"{lib} {v / 1e9:.0f}" for lib, v in r["all"].items())
        print(f"{precision}: {r['flops'] / 1e9:.0f} GFLOP/s (best: {r['by']}; {libs})")


if __name__ == "__main__":
    main()
