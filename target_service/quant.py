"""The target's linear layers from the GGUF's own quantized blocks. Plain
Python, no gRPC.

Every ``nn.Linear`` of the loaded model is replaced by a module built from
the matching GGUF tensor's blocks (``specdec.models.gguf_blocks``), never from
a float copy of the weight.

Backend ``kquant`` (pair ``bfloat16/kquant``): Q4_K and Q6_K tensors run on
our kernel (``target_service/kquant.py``: the file's codes and scales
exactly, bf16-rounded inputs, float32 sums); any other tensor type as in
``int4`` below (bf16, faithful). Backend ``kquant-a8``: the same weights
with each input quantized to int8 per 16 elements and exact int32 products
(``kquant.py``, "a8").

Backends ``int4`` (pair ``bfloat16/int4``) and the lossy ``int4-q8``, on
torch's weight-only integer kernels:

- ``Q4_K`` tensors → ATen's int4 weight-only kernel
  (``_convert_weight_to_int4pack_for_cpu`` / ``_weight_int4pack_mm_for_cpu``,
  group 32). The kernel computes w = (q − 8)·S + Z per group of 32, so the
  file's w = d·sc·q − dmin·m becomes S = d·sc and Z = 8·S − dmin·m. What
  rounds: S and Z are rounded to bfloat16 (the kernel's vectorised path takes
  bf16 scales with bf16 activations; its float32 path is scalar, 40× slower),
  and the layer's input is rounded to bfloat16. The codes are the file's.
- tensors stored with 5 bits or more (``Q6_K``, ``Q5_*``, ``Q8_0``, float):
  ``int4``: their exact float32 dequantization rounded once to bfloat16 and
  run by oneDNN's bf16 GEMM where it is native (else torch's). Faithful:
  bf16 keeps 8 significant bits, Q6_K's codes have 6.
  ``int4-q8`` (**lossy**, named so): requantized to int8 with one scale per
  output row for ``_weight_int8pack_mm``. Q6_K has one scale per 16 weights;
  one per row of 1,536 or 8,960 cannot hold them, so this adds an error of
  the order of Q6_K's own. Opt-in only; ``--target-dtype auto`` considers it
  only within the fidelity bound (docs/benchmarks.md, "Fidelity").

The input embedding keeps the file's quantized rows (``QuantEmbedding``),
dequantized exactly on lookup. Everything else that is not a linear layer
(norms, attention, the residual stream) computes in float32. Each output row of every kernel above
is computed the same way whatever the number of rows, so a 1-token step, a
k-token verify and a batched verify give the same logits for a row
(tests/test_quant.py).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specdec.logging_util import log
from specdec.models import gguf_blocks

logger = logging.getLogger("specdec.target")

QUANT_BACKENDS = ("kquant", "kquant-a8", "int4", "int4-q8")

#: HF module path (Qwen2 / Llama layout) -> GGUF tensor name
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
_GGUF_NAMES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
}


def gguf_tensor_name(module_path: str) -> str | None:
    """The GGUF tensor holding the weight of the linear layer at ``module_path``."""
    if module_path == "lm_head":
        return "output.weight"
    m = _LAYER_RE.match(module_path)
    if m and m.group(3) in _GGUF_NAMES:
        return f"blk.{m.group(1)}.{_GGUF_NAMES[m.group(3)]}.weight"
    return None


@functools.lru_cache(maxsize=8)
def _linear_kinds(gguf_path: str) -> frozenset[str]:
    """The GGUF types of the file's linear-layer tensors (not the embedding)."""
    f = GgufFile(Path(gguf_path))
    return frozenset(t.kind for name, t in f.tensors.items()
                     if name.endswith(".weight") and t.n > 1 and name != "token_embd.weight"
                     and ("blk." in name or name == "output.weight"))


def cpu_supported(backend: str, device: torch.device) -> tuple[bool, str]:
    """Whether ``backend``'s kernel runs on ``device`` (whatever the model)."""
    if device.type != "cpu":
        return False, "the quantized backends run on CPU (CUDA: scripts/gpu_check.sh measures _weight_int4pack_mm)"
    if backend in ("kquant", "kquant-a8"):
        from target_service import kquant

        return kquant.available()
    if backend in ("int4", "int4-q8"):
        return int4_supported(device)
    return False, f"unknown quantized backend {backend!r}"


def supported(backend: str, device: torch.device, gguf_path: Path | None) -> tuple[bool, str]:
    """Whether ``backend`` runs on ``device`` for the model whose GGUF is at
    ``gguf_path``, and if not, why."""
    ok, why = cpu_supported(backend, device)
    if not ok:
        return ok, why
    if gguf_path is None or not Path(gguf_path).is_file():
        return False, "the model has no GGUF on disk (quantized backends read its blocks)"
    try:
        kinds = _linear_kinds(str(gguf_path))
    except Exception as e:  # an unreadable file: not eligible, with the reason
        return False, f"cannot read {Path(gguf_path).name}: {e}"
    if backend in ("kquant", "kquant-a8") and not kinds & {"Q4_K", "Q6_K"}:
        return False, f"the file's linear layers are {', '.join(sorted(kinds))}, not Q4_K/Q6_K"
    if backend in ("int4", "int4-q8") and "Q4_K" not in kinds:
        return False, f"the file's linear layers are {', '.join(sorted(kinds))}: no Q4_K for the int4 kernel"
    return True, ""


def int4_supported(device: torch.device) -> tuple[bool, str]:
    """Whether ATen's CPU int4 kernel runs vectorised here (AVX2 or AVX-512)."""
    try:
        cap = str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        cap = "unknown"
    if cap not in ("AVX2", "AVX512"):
        return False, f"ATen's int4 kernel has no vectorised path at capability {cap}"
    return True, ""


@dataclass
class GgufTensor:
    kind: str  # ggml type name
    n: int  # output features (rows)
    k: int  # input features
    data: np.ndarray  # the raw bytes (memory-mapped)


class GgufFile:
    """The tensors of one GGUF file, by name (memory-mapped, read lazily)."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = Path(path)
        reader = gguf.GGUFReader(str(path))
        self.tensors: dict[str, GgufTensor] = {}
        for t in reader.tensors:
            shape = [int(s) for s in t.shape]  # ggml order: [K, N]
            k = shape[0]
            n = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            self.tensors[t.name] = GgufTensor(t.tensor_type.name, n, k, t.data)

    def get(self, name: str) -> GgufTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ValueError(f"{self.path.name} has no tensor {name!r}") from None


def int4_pack(b: gguf_blocks.Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's packed int4 weight and bf16 scales-and-zeros [K/32, N, 2] for a
    decoded Q4_K tensor: w = (q − 8)·S + Z with S = d·sc, Z = 8·S − dmin·m."""
    if b.kind != "Q4_K" or b.group != 32 or b.minimum is None:
        raise ValueError(f"int4 packing takes Q4_K blocks, not {b.kind}")
    codes = torch.from_numpy(b.codes.astype(np.int32))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
    s = torch.from_numpy(b.scale)  # [N, K/32] float32
    z = 8.0 * s - torch.from_numpy(b.minimum)
    sz = torch.stack([s.t(), z.t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, sz


class Int4Linear(torch.nn.Module):
    """y = x·Wᵀ (+ b) with W in ATen's packed int4 layout; x rounded to bf16,
    y returned in x's dtype."""

    def __init__(self, in_features: int, out_features: int, packed: torch.Tensor, scales_zeros: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.packed = packed
        self.scales_zeros = scales_zeros
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, 32, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=int4 g32 (Q4_K)"


class Int8Linear(torch.nn.Module):
    """y = x·Wᵀ (+ b) with W as int8 codes and one bf16 scale per output row
    (``_weight_int8pack_mm``); x rounded to bf16."""

    def __init__(self, in_features: int, out_features: int, codes: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, source: str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.codes, self.scales, self.source = codes, scales, source
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.codes, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weights=int8 per row (requantized from {self.source}: lossy)")


class Bf16Linear(torch.nn.Module):
    """y = x·Wᵀ (+ b) with W in bf16 (oneDNN prepacked where native); x
    rounded to bf16, y returned in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, source: str) -> None:
        super().__init__()
        from target_service.backends import packed_supported

        self.out_features, self.in_features = weight.shape
        self.source = source
        w = weight.to(torch.bfloat16).contiguous()
        self.onednn = packed_supported(torch.bfloat16, torch.device("cpu"))
        self.weight_bf16 = torch.ops.mkldnn._reorder_linear_weight(w) if self.onednn else w
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if self.onednn:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.weight_bf16, None, "none", [], "")
        else:
            y = torch.nn.functional.linear(x2, self.weight_bf16)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=bf16 (from {self.source})"


def requantize_int8_rows(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, K] and bf16 scales [N] (absmax / 127 per row)."""
    wt = torch.from_numpy(w)
    scale = (wt.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).to(torch.bfloat16)
    codes = torch.round(wt / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scale


def make_linear(backend: str, t: GgufTensor, linear: torch.nn.Linear) -> torch.nn.Module:
    """The module for one linear layer under ``backend``, from its GGUF tensor."""
    if (t.n, t.k) != (linear.out_features, linear.in_features):
        raise ValueError(f"GGUF tensor [{t.n}, {t.k}] does not match the layer "
                         f"[{linear.out_features}, {linear.in_features}]")
    bias = linear.bias
    if backend in ("kquant", "kquant-a8") and t.kind in ("Q4_K", "Q6_K"):
        from target_service.kquant import KQuantLinear

        return KQuantLinear(gguf_blocks.decode(t.data, t.kind, t.n, t.k), bias,
                            acts="a8" if backend == "kquant-a8" else "bf16")
    if t.kind == "Q4_K" and backend not in ("kquant", "kquant-a8"):
        packed, sz = int4_pack(gguf_blocks.decode(t.data, t.kind, t.n, t.k))
        return Int4Linear(t.k, t.n, packed, sz, bias)
    if t.kind in gguf_blocks.DECODERS:
        w = gguf_blocks.decode(t.data, t.kind, t.n, t.k).dequantize()
    elif t.kind in ("F32", "F16", "BF16"):
        w = linear.weight.detach().float().numpy()
    else:
        import gguf

        w = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType[t.kind]).reshape(t.n, t.k).astype(np.float32)
    if backend == "int4-q8":
        codes, scales = requantize_int8_rows(w)
        return Int8Linear(t.k, t.n, codes, scales, bias, t.kind)
    return Bf16Linear(torch.from_numpy(w), bias, t.kind)


class QuantEmbedding(torch.nn.Module):
    """The input embedding as the file stores it: the quantized rows of
    ``token_embd.weight`` in anonymous memory, dequantized on lookup by
    ``gguf.quants.dequantize``, the function the GGUF conversion itself used,
    so each row is bit for bit the float32 row the checkpoint holds.

    Why not that float32 checkpoint tensor: the 1.5B target's is 151,936 ×
    1,536 float32 (890 MiB) behind a file mapping, and its pages become
    resident one token id at a time as requests meet new ids, so RSS creeps
    up for hours with no leak behind it (docs/benchmarks.md, issue 26). The
    Q4_K rows are 131 MB, resident from the start. A lookup dequantizes only
    the rows asked for: 0.17 ms for a step's few tokens, 7 ms for a
    512-token prefill chunk (Zen 4, one thread)."""

    def __init__(self, t: GgufTensor) -> None:
        import gguf

        super().__init__()
        self.qtype = gguf.GGMLQuantizationType[t.kind]
        self.kind = t.kind
        self.num_embeddings, self.embedding_dim = t.n, t.k
        # a private copy: anonymous pages, all resident now, not the file's
        self.rows = np.array(np.asarray(t.data).reshape(t.n, -1), order="C")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        import gguf

        ids = input_ids.detach().cpu().numpy().reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        uniq, inverse = np.unique(ids, return_inverse=True)
        w = gguf.quants.dequantize(self.rows[uniq], self.qtype).reshape(len(uniq), self.embedding_dim)
        out = torch.from_numpy(np.ascontiguousarray(w[inverse], dtype=np.float32))
        return out.reshape(*input_ids.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={self.kind} ({self.nbytes / 2**20:.0f} MiB)"


def quantized_embedding(model: torch.nn.Module, f: "GgufFile") -> str:
    """Replaces ``model``'s input embedding by :class:`QuantEmbedding` when
    the file has ``token_embd.weight`` of the embedding's shape in a type
    ``gguf.quants`` dequantizes; returns what was done, for the log."""
    import gguf

    emb = model.get_input_embeddings()
    t = f.tensors.get("token_embd.weight")
    if not isinstance(emb, torch.nn.Embedding) or t is None:
        return "kept (no token_embd.weight)" if t is None else "kept (not an nn.Embedding)"
    if (t.n, t.k) != tuple(emb.weight.shape):
        return f"kept (token_embd.weight is [{t.n}, {t.k}], the embedding {list(emb.weight.shape)})"
    if t.kind in ("F32", "F16", "BF16") or t.kind not in gguf.GGMLQuantizationType.__members__:
        return f"kept ({t.kind})"
    # no tie to care about: the LM head was replaced by its own GGUF tensor first
    model.set_input_embeddings(QuantEmbedding(t))
    return f"{t.kind} rows"


def apply_quant(model: torch.nn.Module, backend: str, gguf_path: Path, fuse: bool = True,
                fast_layers: bool = True) -> dict[str, int]:
    """Replaces every linear layer of ``model`` (float32, CPU) by its
    ``backend`` module built from ``gguf_path``; returns how many of each
    kind. Raises ValueError when the file lacks a layer's tensor or its shape
    differs. ``fuse`` (kquant): sibling projections of one input run as one
    kernel call (``kquant.fuse_projections``; the same numerics).
    ``fast_layers`` (kquant): the decoder layers' small ops fused
    (``fastlayers.install``; RMSNorm's sum in its own fixed order)."""
    if backend not in QUANT_BACKENDS:
        raise ValueError(f"unknown quantized backend {backend!r}")
    f = GgufFile(gguf_path)
    counts: dict[str, int] = {}
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is torch.nn.Linear]
    for name, mod in targets:
        tname = gguf_tensor_name(name)
        if tname is None:
            raise ValueError(f"no GGUF tensor name known for layer {name!r}")
        t = f.get(tname)
        new = make_linear(backend, t, mod)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, new)
        key = f"{t.kind}->{type(new).__name__}"
        counts[key] = counts.get(key, 0) + 1
    if backend in ("kquant", "kquant-a8") and fuse:  # q/k/v and gate/up in one kernel call each
        from target_service.kquant import fuse_projections

        def decode(path: str) -> gguf_blocks.Blocks:
            t = f.get(gguf_tensor_name(path) or path)
            return gguf_blocks.decode(t.data, t.kind, t.n, t.k)

        counts["fused_calls"] = fuse_projections(model, decode)
    embedding = quantized_embedding(model, f)
    if backend in ("kquant", "kquant-a8") and fast_layers:  # the small ops between them fused (fastlayers.py)
        from target_service import fastlayers

        counts["fast_layers"] = fastlayers.install(model)
    log(logger, logging.INFO, "linear layers from GGUF blocks", backend=backend, file=f.path.name,
        embedding=embedding, **counts)
    return counts

