"""Compute backends for the target model: how its forward pass runs on this
machine. Plain Python, no gRPC.

A backend turns a loaded transformers model into the one the engine runs;
KV caches, rollback and sampling never see the difference, and every forward
(prefill, 1-token step, k-token verify, batched or not) goes through the same
converted modules, so a session computes all its logits in one precision.

- ``eager``: the model as transformers builds it.
- ``packed``: every ``nn.Linear`` weight reordered once, at load time, into
  oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and run
  with ``torch.ops.mkldnn._linear_pointwise``. On CPUs without native BF16 the
  eager float32 GEMM (MKL, small M) costs about M times the M=1 product, so a
  k-token verify costs k steps; the prepacked product is nearly flat in M.
  Float32 on any x86 CPU with oneDNN; bfloat16 only where oneDNN has a native
  BF16 path (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: AVX-512 BF16,
  AMX or AVX-NE-CONVERT).
- ``bf16w`` (pair ``bfloat16/bf16w``): every ``nn.Linear`` weight stored as
  bfloat16 and applied by a small AVX2+FMA kernel that widens it to float32 in
  registers (``target_service/bf16w.py``); everything else, and every
  activation, is float32. Half the bytes of float32 and a nearly flat cost
  in k on CPUs without native BF16. Its numerics are its own: bf16-rounded
  weights (as bf16 eager rounds them) with float32 activations.

- ``kquant`` (pair ``bfloat16/kquant``) and ``int4`` (``bfloat16/int4``):
  the linear layers built from the GGUF's own quantized blocks
  (``target_service/quant.py``): Q4_K and Q6_K codes run by our kernel
  (``target_service/kquant.py``), or Q4_K on torch's int4 weight-only kernel
  with the 6-bit tensors in bf16. ``int4-q8`` is ``int4`` with the 6-bit
  tensors requantized to int8 per row: **lossy**, explicit only.
- ``kquant-a8`` (pair ``bfloat16/kquant-a8``): the kquant weights with each
  linear layer's input quantized to int8 per 16 elements (a float32 scale
  each) and the products summed exactly in int32 (AVX-512 VNNI, or AVX2
  ``vpmaddubsw``), as llama.cpp computes K-quants; the same bits on both
  builds. It rounds the activations more than ``kquant`` does (mean KL 3.2e-4
  against the file, ``kquant`` 2.6e-5), less than transformers' bf16 does
  (bf16 eager 5.1e-4): ``auto`` may choose it where calibration finds it
  within the bound of bf16 eager's fidelity and faster.

For the quantized pairs "bfloat16" names the rounding of each linear
layer's input (int8 for kquant-a8); everything else computes in float32.

``cpu_info()`` names what the CPU offers; ``eligible_pairs()`` lists the
(dtype, backend) pairs worth calibrating on a device.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

BACKENDS = ("eager", "packed", "bf16w", "kquant", "kquant-a8", "int4", "int4-q8")
#: backends whose linear layers come from the GGUF's quantized blocks
QUANT_BACKENDS = ("kquant", "kquant-a8", "int4", "int4-q8")
#: quantized backends ``auto`` may choose (fidelity permitting: within the
#: bound of bf16 eager's, target_service/calibration.py
#: ``fidelity_admissible``). int4-q8 is lossy (its 6-bit tensors requantized
#: to 8 bits): explicit only
AUTO_QUANT_BACKENDS = ("kquant", "kquant-a8", "int4")
DTYPES = ("bfloat16", "float32", "float16")

# cpu flags reported (lscpu / /proc/cpuinfo names)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "avx_ne_convert", "avx_vnni")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # e.g. "AMD EPYC" / "Intel(R) Xeon(R) ..."
    flags: tuple[str, ...]  # the ISA_FLAGS this CPU has
    capability: str  # torch's ATen dispatch level (DEFAULT, AVX2, AVX512, ...)
    mkldnn_bf16: bool  # oneDNN has a native bf16 GEMM here

    @property
    def isa(self) -> str:
        """One line: the ATen capability and the flags, e.g. ``AVX2 [avx2]``."""
        return f"{self.capability} [{' '.join(self.flags)}]"


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, val = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.processor(), platform.machine()):
                    model = val.strip()
                elif key == "flags":
                    flags = set(val.split())
                    break
    except OSError:
        pass
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # very old torch
        capability = "unknown"
    return CpuInfo(
        model=model,
        flags=tuple(f for f in ISA_FLAGS if f in flags),
        capability=capability,
        mkldnn_bf16=_mkldnn_bf16(),
    )


def _mkldnn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def packed_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the ``packed`` backend runs this dtype on this device."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return cpu_info().mkldnn_bf16
    return False


def eligible_pairs(device: torch.device, gguf_path: Path | None = None) -> list[tuple[str, str]]:
    """(dtype, backend) pairs ``--target-dtype auto --target-backend auto``
    chooses among on ``device``. On CUDA: bf16 eager (fp16 where the GPU has
    no bf16). On CPU: bf16 and float32 eager, float32 packed, bf16 packed
    where oneDNN has native BF16, bf16w, and, when the model's GGUF is at
    ``gguf_path`` with Q4_K layers, the quantized pairs this CPU runs
    (``kquant``, ``kquant-a8``, ``int4``; chosen only within the fidelity bound)."""
    if device.type == "cuda":
        return [("bfloat16" if torch.cuda.is_bf16_supported() else "float16", "eager")]
    if device.type != "cpu":
        return [("float32", "eager")]
    pairs = [("bfloat16", "eager"), ("float32", "eager")]
    if packed_supported(torch.float32, device):
        pairs.append(("float32", "packed"))
    if packed_supported(torch.bfloat16, device):
        pairs.append(("bfloat16", "packed"))
    if bf16w_supported(torch.bfloat16, device):
        pairs.append(("bfloat16", "bf16w"))
    if gguf_path is not None:
        from target_service import quant

        pairs += [("bfloat16", b) for b in AUTO_QUANT_BACKENDS if quant.supported(b, device, gguf_path)[0]]
    return pairs


def bf16w_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the ``bf16w`` backend runs here (bf16 weights, x86-64 CPU with
    AVX2 + FMA and a C compiler to build its kernel)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    from target_service import bf16w

    return bf16w.available()[0]


def load_dtype(dtype: torch.dtype, backend: str) -> torch.dtype:
    """The dtype to load the checkpoint in before ``apply_backend`` (bf16w
    loads bf16, half the memory of float32, and widens what is not a linear
    weight afterwards; the quantized backends load float32, the exact
    dequantization, and replace the linear layers from the GGUF)."""
    return torch.float32 if backend in QUANT_BACKENDS else dtype


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight lives in oneDNN's prepacked layout.

    The packed weight is an opaque MKLDNN tensor held as a plain attribute
    (not a parameter): it cannot be moved, saved or trained, only run.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.dtype = w.dtype
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        bias = linear.bias
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=onednn"


def replace_linears(model: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module]) -> int:
    """Replaces every ``nn.Linear`` in ``model`` by ``make(linear)``, one at a
    time (the plain weight is dropped as soon as its replacement exists, so
    peak memory grows by one layer, not one model). Returns how many."""
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(mod))
    return len(targets)


_compute_threads: int | None = None


def set_compute_threads(threads: int) -> None:
    """The cores the target's compute may use (``--threads``; 0 = torch's
    default, all cores). Backends divide them between torch and their own
    kernels (:func:`apply_backend`)."""
    global _compute_threads
    if threads > 0:
        _compute_threads = threads
    elif _compute_threads is None:
        _compute_threads = torch.get_num_threads()


def compute_threads() -> int:
    set_compute_threads(0)
    assert _compute_threads is not None
    return _compute_threads


#: backends whose own kernel takes every compute thread (torch keeps one)
KERNEL_BACKENDS = ("bf16w", "kquant", "kquant-a8")


def set_backend_threads(backend: str) -> None:
    """Divides the compute threads between torch and ``backend``'s kernel
    (see :func:`apply_backend`); the engine calls it again whenever it sets
    threads, so that nothing undoes the division."""
    from target_service import bf16w

    threads = compute_threads()
    bf16w.set_threads(threads)
    if backend in ("kquant", "kquant-a8"):
        from target_service import kquant

        kquant.set_threads(threads)
    torch.set_num_threads(1 if backend in KERNEL_BACKENDS else threads)


def apply_backend(model: torch.nn.Module, backend: str, dtype: torch.dtype, device: torch.device,
                  gguf_path: Path | None = None) -> torch.nn.Module:
    """Converts a loaded (eval-mode, on ``device``) model for ``backend``
    (the quantized backends build its linear layers from ``gguf_path``).

    Threads: bf16w and kquant run their kernels on all compute threads and
    torch's own ops on one (torch's OpenMP workers spin after each op and
    would take the cores the kernel's threads need: measured 450 → 290 ms per
    step on the 1.5B target with bf16w, 55 → 27 ms with kquant); every other
    backend gives torch all compute threads."""
    if device.type == "cpu":
        set_backend_threads(backend)
    if backend in QUANT_BACKENDS:
        from target_service import quant

        if dtype != torch.bfloat16 or gguf_path is None:
            raise ValueError(f"backend {backend!r} runs bfloat16 activations from the model's GGUF "
                             f"(asked for {str(dtype).removeprefix('torch.')}"
                             f"{'' if gguf_path else ', and no GGUF is on disk for this model'})")
        ok, why = quant.supported(backend, device, gguf_path)
        if not ok:
            raise ValueError(f"backend {backend!r} cannot run here: {why}")
        quant.apply_quant(model, backend, gguf_path)
        return model
    if backend == "eager":
        return model
    if backend == "packed":
        if not packed_supported(dtype, device):
            why = (
                "it runs on CPU only" if device.type != "cpu"
                else f"oneDNN has no native {str(dtype).removeprefix('torch.')} GEMM on this CPU ({cpu_info().isa})"
            )
            raise ValueError(f"backend 'packed' cannot run {str(dtype).removeprefix('torch.')} on {device}: {why}")
        replace_linears(model, PackedLinear)
        return model
    if backend == "bf16w":
        from target_service import bf16w

        ok, why = bf16w.available()
        if dtype != torch.bfloat16 or device.type != "cpu" or not ok:
            raise ValueError(
                "backend 'bf16w' runs bfloat16 weights on an x86-64 CPU with AVX2 and FMA"
                + (f": {why}" if why else f" (asked for {str(dtype).removeprefix('torch.')} on {device})")
            )
        replace_linears(model, bf16w.Bf16WeightLinear)
        # everything else (embeddings, norms, rotary buffers) computes in
        # float32: activations stay float32 end to end; the values are the
        # bf16-rounded weights, widened exactly
        for mod in model.modules():
            if isinstance(mod, bf16w.Bf16WeightLinear):
                continue
            for p in mod.parameters(recurse=False):
                if p.is_floating_point() and p.dtype != torch.float32:
                    p.data = p.data.float()
            for key, buf in list(mod._buffers.items()):
                if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                    mod._buffers[key] = buf.float()
        return model
    raise ValueError(f"unknown target backend {backend!r}; choose one of {', '.join(BACKENDS)} or auto")
