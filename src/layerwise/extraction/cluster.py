"""The Ray cluster a run uses: a running one it connects to, or a local one it starts and ends with itself.

:class:`RayCluster` is entered around a Ray run. With ``address`` (or a Ray already initialised in this process)
it connects and leaves the cluster as it found it. Otherwise it starts a local cluster and that cluster is the
run's own: it is shut down when the run ends (returns, fails, is interrupted), and if the driver process dies
without a word (``kill -9``, the out-of-memory killer) the guard process (:mod:`layerwise.extraction.guard`,
started before Ray, outside Ray's process tree) ends every process of that cluster, which Ray alone does not do
(its agents outlived a killed driver by minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

from .guard import MARKER_VARIABLE
from .signals import SignalState


class Guard:
    """The guard process of one local cluster (see :mod:`layerwise.extraction.guard`).

    :meth:`start` starts it (before Ray, so it is no part of Ray's tree); :meth:`watch` tells it the cluster's
    session directory; :meth:`close` lets it end the cluster's processes now (the driver's death does the same).
    """

    def __init__(self) -> None:
        self.marker = uuid.uuid4().hex
        self._pipe: int | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "Guard":
        """Start the guard process watching this one."""
        read, write = os.pipe()  # both ends close-on-exec: Ray's processes never hold the writer
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "layerwise.extraction.guard", str(os.getpid()), self.marker],
                stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        self._pipe = write
        return self

    def environment(self) -> dict[str, str]:
        """The variable that marks the processes of the cluster started while it is set."""
        return {MARKER_VARIABLE: self.marker}

    def watch(self, session_dir: str | None) -> None:
        """Tell the guard the cluster's session directory (its processes name it on their command lines)."""
        if self._pipe is not None and session_dir:
            try:
                os.write(self._pipe, f"session {session_dir}\n".encode(errors="surrogateescape"))
            except OSError:
                pass  # a guard that is gone cannot be told; the marker still finds the processes

    def close(self) -> None:
        """End the cluster's processes now (after Ray's own shutdown, whatever it left) and let the guard exit."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            os.close(pipe)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the guard has ended what it found (tests, and a driver that must leave nothing behind)."""
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass


def session_dir(ray: Any) -> str | None:
    """The session directory of the local cluster this process started: where its node's sockets live
    (``SESSION/sockets/raylet``, from ``ray.nodes()``), or ``None`` when Ray does not say."""
    try:
        for node in ray.nodes():
            socket = node.get("RayletSocketName") or node.get("ObjectStoreSocketName")
            if node.get("Alive") and socket and os.sep in socket:
                return os.path.dirname(os.path.dirname(socket))
    except Exception:  # noqa: BLE001 - without it the guard goes by its marker alone
        return None
    return None


class RayCluster:
    """The cluster of one Ray run, as a context manager: connects to ``address`` (or the Ray this process already
    runs), else starts a local cluster guarded to end with the run and with this process.

    Attributes:
        owned: the cluster was started here (and ends with the run).
    """

    def __init__(self, ray: Any, address: str | None):
        self.ray, self.address = ray, address
        self.owned = address is None and not ray.is_initialized()
        self.guard: Guard | None = None
        self.signals: SignalState | None = None

    def __enter__(self) -> "RayCluster":
        if not self.owned:
            if not self.ray.is_initialized():
                self.ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
            return self
        self.guard = Guard().start()
        saved = {k: os.environ.get(k) for k in self.guard.environment()}
        os.environ.update(self.guard.environment())  # inherited by every process of the cluster, and only them
        self.signals = SignalState.save()  # Ray's shutdown leaves its signal handling behind: put back at the exit
        try:
            self.ray.init(include_dashboard=False, log_to_driver=False)
        except BaseException:
            self.guard.close()
            self.signals.restore()
            raise
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.guard.watch(session_dir(self.ray))
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.owned:
            return
        try:
            self.ray.shutdown()
        finally:
            if self.signals is not None:
                self.signals.restore()
            if self.guard is not None:
                self.guard.close()


__all__ = ["Guard", "RayCluster", "session_dir"]
