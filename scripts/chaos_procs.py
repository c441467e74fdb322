"""The chaos soak's processes (scripts/chaos_soak.py): one ``specdec serve``
service per object, killed and restarted on its own ports, and the RSS of
each sampled while the soak runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from specdec_app.loadbench import rss_mb as proc_rss_mb  # noqa: E402
from tests.stack import free_port, scrape_metrics, wait_serving  # noqa: E402


@dataclass
class Life:
    pid: int
    started: float
    ready: float | None = None
    ended: float | None = None


@dataclass
class Service:
    """One ``specdec serve <kind>`` process, restartable on the same ports."""

    name: str
    kind: str  # draft | target | orchestrator
    args: list[str]
    log_dir: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    lives: list[Life] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, t0: float) -> None:
        cmd = [sys.executable, "-m", "specdec_app.cli", "serve", self.kind, "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--log-level", "warning", *self.args]
        log = open(self.log_dir / f"{self.name}.log", "ab")  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.lives.append(Life(self.proc.pid, time.monotonic() - t0))

    def wait_ready(self, t0: float, timeout_s: float = 300) -> None:
        assert self.proc is not None
        wait_serving(self.address, timeout_s, proc=self.proc)
        self.lives[-1].ready = time.monotonic() - t0

    def kill(self, t0: float) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.lives and self.lives[-1].ended is None:
            self.lives[-1].ended = time.monotonic() - t0

    def stop(self, t0: float, timeout_s: float = 20) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.lives and self.lives[-1].ended is None:
            self.lives[-1].ended = time.monotonic() - t0

    def alive_during(self, t_from: float, t_to: float) -> bool:
        """Serving for the whole interval (one life covers it)."""
        return any(lf.ready is not None and lf.ready <= t_from and (lf.ended is None or lf.ended >= t_to)
                   for lf in self.lives)

    def alive_at(self, t: float) -> bool:
        return self.alive_during(t, t)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape_metrics(self.metrics_port)


def rss_mb(pid: int) -> float | None:
    """Resident set size in MiB: psutil when installed, else /proc's VmRSS; None when the process is gone."""
    try:
        import psutil
    except ImportError:
        return proc_rss_mb(pid)
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return None


class RssSampler:
    """Samples every live process's RSS once per ``interval`` on a thread: {(name, life): [(t, MiB)]}."""

    def __init__(self, services: list[Service], t0: float, interval: float = 1.0) -> None:
        self.services, self.t0, self.interval = services, t0, interval
        self.series: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            for s in self.services:
                if s.proc is not None and s.proc.poll() is None and s.lives and s.lives[-1].ready is not None:
                    mb = rss_mb(s.proc.pid)
                    if mb:  # None or 0: gone (a killed process not yet reaped reads 0)
                        key = (s.name, len(s.lives) - 1)
                        self.series.setdefault(key, []).append((time.monotonic() - self.t0, round(mb, 1)))
            self._stop.wait(self.interval)
