"""The calibration cache: measured curves, fidelity and kernel tuning in one
JSON file per machine identity (CPU, ISA limits, threads, torch, kernels)
and model. Plain Python, no gRPC."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    import torch

from specdec.logging_util import log

logger = logging.getLogger("specdec.target")

#: 3: t(k) timed in rounds over every k (calibration.measure_curve), so
#: curves measured k after k are measured again
CACHE_VERSION = 3
Curve = dict[int, float]  # k -> ms for one forward pass of k new tokens
Pair = tuple[str, str]  # (dtype, backend)
Measured = tuple[Curve, "dict[str, object] | None"]  # a pair's curve and its fidelity (or None)


def pair_key(pair: Pair) -> str:
    return f"{pair[0]}/{pair[1]}"


class CalibrationCache:
    """Measured curves in one JSON file per (machine, model, threads, torch):
    a machine whose CPU, thread count or torch changes measures again."""

    def __init__(self, root: Path, identity: Mapping[str, object]) -> None:
        self.identity = {"version": CACHE_VERSION, **identity}
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        self.path = Path(root) / f"{digest}.json"
        self._data: dict[str, Curve] | None = None
        self._fidelity: dict[str, dict[str, object]] = {}
        self._tuning: dict[str, dict[str, object]] = {}

    def _load(self) -> dict[str, Curve]:
        if self._data is None:
            self._data = {}
            try:
                raw = json.loads(self.path.read_text())
                if raw.get("identity") == json.loads(json.dumps(self.identity)):
                    self._data = {key: {int(k): float(v) for k, v in c.items()} for key, c in raw["curves"].items()}
                    self._fidelity = {key: dict(f) for key, f in (raw.get("fidelity") or {}).items()}
                    self._tuning = {key: dict(t) for key, t in (raw.get("tuning") or {}).items()}
            except (OSError, ValueError, KeyError, AttributeError, TypeError):
                pass
        return self._data

    def get(self, pair: Pair) -> Curve | None:
        return self._load().get(pair_key(pair))

    def get_entry(self, pair: Pair) -> Measured | None:
        """(curve, fidelity or None), or None when the pair was not measured."""
        curve = self.get(pair)
        return None if curve is None else (curve, self._fidelity.get(pair_key(pair)))

    def get_tuning(self, pair: Pair) -> dict[str, object]:
        """The kernel settings measured with ``pair``'s curve ({} if none)."""
        self._load()
        return dict(self._tuning.get(pair_key(pair), {}))

    def put(self, pair: Pair, curve: Curve, fidelity: "dict[str, object] | None" = None,
            tuning: "dict[str, object] | None" = None) -> None:
        data = self._load()
        data[pair_key(pair)] = dict(curve)
        if fidelity is not None:
            self._fidelity[pair_key(pair)] = dict(fidelity)
        if tuning:
            self._tuning[pair_key(pair)] = dict(tuning)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"identity": self.identity, "curves": data, "fidelity": self._fidelity,
                                       "tuning": self._tuning}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache only costs a re-measure next start
            log(logger, logging.WARNING, "could not write the calibration cache", path=str(self.path), error=repr(e))


def _kernel_digest() -> str:
    from target_service.bf16w import C_SOURCE
    from target_service.kquant import _SOURCE

    return hashlib.sha256((C_SOURCE + _SOURCE.read_text()).encode()).hexdigest()[:12]


def machine_identity(device: "torch.device") -> dict[str, object]:
    """What makes a measured curve valid: CPU (or GPU), ISA limits in force,
    threads and torch."""
    import torch

    from target_service import attention, fastlayers
    from target_service.backends import compute_threads, cpu_info

    info = cpu_info()
    ident: dict[str, object] = {
        "cpu": info.model,
        "isa": info.isa,
        "mkldnn_bf16": info.mkldnn_bf16,
        "threads": compute_threads(),
        "torch": torch.__version__,
        "device": str(device),
        # runtime ISA caps (the AVX2 emulation of docs/benchmarks.md)
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        "kernels": _kernel_digest(),  # a changed bf16w kernel measures again
        "attention": attention.IDENTITY,  # a changed attention path measures again
        "layers": fastlayers.IDENTITY,  # so does a changed decoder-layer path (kquant)
    }
    if device.type == "cuda":
        ident["gpu"] = torch.cuda.get_device_name(device)
    return ident
