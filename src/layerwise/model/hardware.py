"""What this machine's CPU can do fast: the instruction sets that decide whether reduced precision pays on CPU.

bfloat16 matmul is about 4x faster than float32 on a CPU with AVX-512 BF16 or AMX, and hundreds of times slower on
one without (measured on machines of the development kind); float16 is native only with AVX-512 FP16 or AMX FP16.
Nothing here is assumed: the flags are read from ``/proc/cpuinfo`` (Linux), else from torch's own detection, and
reduced precision on CPU stays an explicit choice that is warned about where the CPU lacks it.
"""

from __future__ import annotations

import functools
import warnings

import torch

FAST_ON_CPU = {  # dtype -> CPU flags any one of which makes it native
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


class PrecisionWarning(UserWarning):
    """Reduced precision asked for on a CPU that runs it slowly (no native instructions)."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``, ``avx512_vnni``...).

    Read from ``/proc/cpuinfo``; where it cannot be read, torch's capability (``AVX512`` / ``AVX2``) gives the
    vector width only, which never implies bf16.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    capability = torch.backends.cpu.get_cpu_capability().lower()  # "avx512", "avx2", "default"
    return frozenset({"avx512": {"avx512f", "avx2"}, "avx2": {"avx2"}}.get(capability, set()))


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``"AMD EPYC"``), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def native_on_cpu(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether ``dtype`` runs natively on this CPU (float32 always does)."""
    need = FAST_ON_CPU.get(dtype)
    return need is None or bool(set(need) & (cpu_flags() if flags is None else flags))


def check_cpu_dtype(dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None) -> None:
    """Warn (:class:`PrecisionWarning`) when reduced precision is asked for on a CPU without native support."""
    if device.type != "cpu" or native_on_cpu(dtype, flags):
        return
    name = str(dtype).replace("torch.", "")
    warnings.warn(
        f"compute_dtype={name!r} on this CPU: it has none of {', '.join(FAST_ON_CPU[dtype])}, so {name} runs emulated "
        f"and far slower than float32 (and less exact); use compute_dtype='float32' on this machine, or a GPU",
        PrecisionWarning, stacklevel=3,
    )


__all__ = ["FAST_ON_CPU", "PrecisionWarning", "check_cpu_dtype", "cpu_flags", "cpu_model", "native_on_cpu"]
