"""Memory: how much this process may still take, sizes written by people (``"4GB"``), and the check made before
weights are loaded. Imports no torch (CUDA's free memory is asked only when a CUDA device is named).

Where the limit comes from, the lowest wins:

* the cgroup the process runs in: v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes -
  memory.usage_in_bytes`` (containers, ``systemd-run -p MemoryMax=``, Kubernetes);
* the process's own ``RLIMIT_DATA`` and ``RLIMIT_AS`` (``ulimit -d`` / ``-v``) minus what it uses of them;
* ``MemAvailable`` of ``/proc/meminfo`` (what the kernel can give without swapping);
* on a CUDA device, the device's free memory instead.

Example::

    >>> parse_size("4GB"), parse_size("512MiB"), parse_size(2**30)
    (4000000000, 536870912, 1073741824)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_NO_LIMIT = 2**60  # cgroup v1 writes 9223372036854771712 for "no limit"


def parse_size(value: object, name: str = "max_memory") -> int:
    """Bytes from ``"4GB"`` (10^9), ``"4GiB"`` (2^30), ``"512MB"``, ``"1.5g"`` or an int of bytes.

    Raises:
        ModelLoadError: anything else, naming the value and the units.
    """
    if isinstance(value, bool):
        raise ModelLoadError(f"{name} must be a size such as '4GB' or '512MiB', got {value!r}")
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        size = int(value)
        if size < 2**20:
            raise ModelLoadError(f"{name}={value!r} is {size:,} bytes, less than 1 MiB: a number without a unit is "
                                 f"bytes. Did you mean '{size}GB'? Units: B, KB, MB, GB, TB and KiB, MiB, GiB, TiB")
        return size
    match = _SIZE_RE.match(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ModelLoadError(f"{name} must be a size such as '4GB', '512MiB' or a number of bytes, got {value!r}; "
                             f"units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024)")
    return int(float(match.group(1)) * _UNITS[unit])


def human(size: float) -> str:
    """``1.23 GB`` / ``456 MB`` / ``300 kB``: a size in the units of the messages (powers of 1000)."""
    if abs(size) >= 1e9:
        return f"{size / 1e9:,.2f} GB"
    return f"{size / 1e6:,.0f} MB" if abs(size) >= 1e6 else f"{size / 1e3:,.0f} kB"


@dataclass(frozen=True)
class Available:
    """What this process may still take: ``bytes``, and ``source``, the limit that sets it (for messages)."""

    bytes: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" or not text.isdigit() else int(text)


def _own_cgroups() -> dict[str, str]:
    """``{"": path}`` for cgroup v2, ``{"memory": path}`` for v1, from ``/proc/self/cgroup``."""
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                found[controller] = path
    except (OSError, ValueError):
        pass
    return found


def _cgroup_room() -> Available | None:
    groups = _own_cgroups()
    root = Path("/sys/fs/cgroup")
    candidates = []
    if "" in groups:  # v2 (unified)
        base = root / groups[""].lstrip("/")
        candidates += [(base / "memory.max", base / "memory.current"),
                       (root / "memory.max", root / "memory.current")]
    if "memory" in groups:  # v1
        for base in (root / "memory" / groups["memory"].lstrip("/"), root / "memory"):
            candidates.append((base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"))
    for limit_path, usage_path in candidates:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            usage -= _reclaimable(limit_path.parent)  # page cache the kernel drops before it kills anything
            return Available(max(0, limit - usage), f"the cgroup limit of {human(limit)} ({limit_path})")
    return None


def _reclaimable(group: Path) -> int:
    """Bytes of inactive file pages in a cgroup (v2 ``inactive_file``, v1 ``total_inactive_file``): counted in its
    usage, dropped before anything is killed."""
    try:
        for line in (group / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory (RSS) in bytes, from ``/proc/self/statm`` (one short read: cheap enough for
    every request a server admits); ``0`` where it cannot be read (no ``/proc``)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _rlimit_room() -> list[Available]:
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return []
    out = []
    for name, field, flag in (("RLIMIT_DATA", "VmData", "ulimit -d"), ("RLIMIT_AS", "VmSize", "ulimit -v")):
        soft, _ = resource.getrlimit(getattr(resource, name))
        used = _status_kb(field)
        if soft != resource.RLIM_INFINITY and used is not None:
            out.append(Available(max(0, soft - used), f"the process limit {name} of {human(soft)} ({flag})"))
    return out


def _meminfo_available() -> Available | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return Available(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo")
    except (OSError, ValueError):
        pass
    return None


def available(device: str = "cpu") -> Available | None:
    """What this process may still allocate on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``), the lowest of the
    limits of the module docstring; ``None`` where none can be read."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return Available(int(free), f"the free memory of {device}")
    found = [a for a in (_cgroup_room(), *_rlimit_room(), _meminfo_available()) if a is not None]
    return min(found, key=lambda a: a.bytes) if found else None


def available_memory() -> int | None:
    """Bytes of CPU memory this process may still take (:func:`available`), or ``None``."""
    room = available()
    return room.bytes if room is not None else None


def check_fits(needed: int, what: str, fixes: str, device: str = "cpu", margin: float = 1.1) -> None:
    """Refuse, before allocating, ``needed`` bytes (times ``margin``) that the process cannot take.

    Args:
        needed: bytes about to be allocated.
        what: what they are for (``"layers 0..16 of llama (bfloat16)"``).
        fixes: what the user can do instead (one sentence).
        device: where they go.

    Raises:
        ModelLoadError: with the numbers, the limit that sets them, and ``fixes``.
    """
    room = available(device)
    if room is not None and needed * margin > room.bytes:
        raise ModelLoadError(
            f"{what} need {human(needed)} of memory and this process may take {human(room.bytes)} more "
            f"(set by {room.source}); loading them would be killed by the system. {fixes}")


__all__ = ["Available", "available", "available_memory", "check_fits", "human", "parse_size", "resident_bytes"]
