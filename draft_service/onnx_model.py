"""A causal LM exported to ONNX (with past key values), run by a plain
``onnxruntime.InferenceSession`` with an explicit, rollback-able KV cache.

Shapes: S = new tokens in one call, V = vocabulary (logits) size, L = layers,
H = KV heads, D = head size, T = tokens held in the cache, C = cache capacity.

Two cache modes, chosen from the graph:
- *shared buffer* (graphs using ``GroupQueryAttention``, i.e. the
  onnxruntime-genai builder's exports): one preallocated [1, H, C, D] buffer per
  past/present pair, bound as both input and output, so a step writes only its
  new positions in place. The valid length comes from the attention mask.
  ``crop(n)`` is O(1). The CPU buffers grow by doubling.
- *concat*: present = past ++ new, returned as fresh arrays; ``crop(n)``
  slices. Used for any other graph (e.g. ``torch.onnx`` exports).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnxruntime as ort

from draft_service.config import check_spin
from specdec.logging_util import log

logger = logging.getLogger("specdec.draft.onnx")

_ORT_TO_NUMPY: dict[str, Any] = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}
_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_DEFAULT_CPU_CAPACITY = 256


def select_providers(execution: str) -> list[str]:
    """'auto' -> CUDA when onnxruntime has it, else CPU; 'cuda' requires it."""
    available = ort.get_available_providers()
    if execution not in ("auto", "cpu", "cuda"):
        raise ValueError(f"execution must be auto, cpu or cuda, got {execution!r}")
    has_cuda = "CUDAExecutionProvider" in available
    if execution == "cuda" and not has_cuda:
        raise RuntimeError(f"execution=cuda but onnxruntime has no CUDAExecutionProvider ({available})")
    if execution in ("auto", "cuda") and has_cuda:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def resolve_execution(execution: str) -> str:
    """'auto' | 'cpu' | 'cuda' -> the concrete 'cpu' or 'cuda' that will be used."""
    return "cuda" if select_providers(execution)[0] == "CUDAExecutionProvider" else "cpu"


@dataclass
class KVCache:
    """Per-session cache state. ``length`` = T tokens held (positions 0..T-1)."""

    length: int = 0
    capacity: int = 0
    # shared-buffer mode: past name -> (OrtValue [1,H,C,D], backing numpy array or None on device)
    shared: dict[str, tuple[ort.OrtValue, np.ndarray | None]] = field(default_factory=dict)
    # concat mode: past name -> array [1,H,T,D]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def free(self) -> None:
        """Drops the buffers (the state then holds nothing, like a fresh CPU
        state): for a state nobody will run again, so that its memory goes
        now and not whenever the garbage collector meets a cycle around it."""
        self.shared, self.arrays, self.length, self.capacity = {}, {}, 0, 0

    def crop(self, n: int) -> None:
        """Keeps the first ``n`` positions (0 <= n <= length)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside [0, {self.length}]")
        self.length = n
        if self.arrays:
            self.arrays = {k: v[:, :, :n, :] for k, v in self.arrays.items()}


class OnnxCausalLM:
    """Loads ``<model_dir>/model.onnx`` and runs incremental forward passes.

    Inputs/outputs, KV dtype and shapes are read from the graph (plus
    ``genai_config.json`` / ``config.json`` for sizes the graph leaves symbolic).
    ``kv_mode``: 'auto' (shared buffer when the graph allows it), 'shared' or
    'concat'. ``max_cache_tokens`` caps one state's length (default: the
    model's context length). Not thread-safe per state; one
    ``InferenceSession`` serves all states.
    """

    def __init__(
        self,
        model_dir: Path | str,
        *,
        execution: str = "auto",
        intra_op_threads: int = 0,
        spin: str = "on",
        max_cache_tokens: int | None = None,
        kv_mode: str = "auto",
        filename: str = "model.onnx",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.providers = select_providers(execution)
        self.device = "cuda" if self.providers[0] == "CUDAExecutionProvider" else "cpu"
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads > 0:
            opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
        check_spin(spin)
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0" if spin == "off" else "1")
        if spin == "run":  # spin between a run's ops, and stop as soon as the run returns
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        opts.log_severity_level = 3
        path = self.model_dir / filename
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {path}")
        self.session = ort.InferenceSession(str(path), sess_options=opts, providers=self.providers)

        meta = _read_meta(self.model_dir)
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        if "input_ids" not in inputs or "logits" not in outputs:
            raise ValueError(f"{path}: expected input_ids -> logits, got {list(inputs)} -> {list(outputs)}")
        self.has_attention_mask = "attention_mask" in inputs
        self.has_position_ids = "position_ids" in inputs
        self.ids_dtype = _ORT_TO_NUMPY[inputs["input_ids"].type]
        layers: dict[int, dict[str, str]] = {}
        for name in inputs:
            m = _PAST_RE.match(name)
            if m:
                layers.setdefault(int(m.group(1)), {})[m.group(2)] = name
        self.num_layers = len(layers)
        # past name -> present name
        self.kv_pairs: list[tuple[str, str]] = []
        for i in sorted(layers):
            for kind in ("key", "value"):
                past = layers[i][kind]
                present = f"present.{i}.{kind}"
                if present not in outputs:
                    raise ValueError(f"{path}: {past} has no matching output {present}")
                self.kv_pairs.append((past, present))
        if not self.kv_pairs:
            raise ValueError(f"{path}: no past_key_values.N.key/value inputs")

        first = inputs[self.kv_pairs[0][0]]
        self.kv_type = first.type
        if self.kv_type == "tensor(bfloat16)":
            self.kv_dtype: Any = None
        else:
            self.kv_dtype = _ORT_TO_NUMPY[self.kv_type]
        shape = list(first.shape)  # e.g. ['batch_size', 2, 'past_sequence_length', 'kv_cache_dim']
        if len(shape) != 4:
            raise ValueError(f"{path}: unexpected KV shape {shape}")
        self.seq_axis = next(
            (j for j, d in enumerate(shape) if isinstance(d, str) and "seq" in d.lower()), 2
        )
        if self.seq_axis != 2:
            raise ValueError(f"{path}: KV sequence axis {self.seq_axis} (expected 2) in {shape}")
        self.num_kv_heads = int(shape[1]) if isinstance(shape[1], int) else int(meta["num_kv_heads"])
        self.head_size = int(shape[3]) if isinstance(shape[3], int) else int(meta["head_size"])
        vdim = outputs["logits"].shape[-1]
        self.vocab_size = int(vdim) if isinstance(vdim, int) else int(meta["vocab_size"])
        # a pruned LM head ([B, 1, V]) returns the last position's logits only
        self.all_logits = not (isinstance(outputs["logits"].shape[1], int) and outputs["logits"].shape[1] == 1)
        self.context_length = int(meta.get("context_length") or 0) or None
        self.eos_token_ids: list[int] = list(meta.get("eos_token_ids", []))

        if kv_mode not in ("auto", "shared", "concat"):
            raise ValueError(f"kv_mode must be auto, shared or concat, got {kv_mode!r}")
        has_gqa = "GroupQueryAttention" in _op_types(path)
        if kv_mode == "shared" and not has_gqa:
            raise ValueError("kv_mode=shared needs a GroupQueryAttention graph")
        self.shared_buffer = has_gqa and kv_mode != "concat"
        if self.device == "cuda" and not self.shared_buffer:
            raise ValueError("the CUDA path needs a GroupQueryAttention (builder) export")
        self.max_cache_tokens = max_cache_tokens or self.context_length or 4096
        log(
            logger,
            logging.INFO,
            "onnx model loaded",
            path=str(path),
            device=self.device,
            layers=self.num_layers,
            kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            kv_type=self.kv_type,
            vocab=self.vocab_size,
            all_logits=self.all_logits,
            shared_buffer=self.shared_buffer,
            context_length=self.context_length,
        )

    # ------------------------------------------------------------------ state

    def new_state(self) -> KVCache:
        """A state with no tokens. On CUDA its buffer is allocated now, at
        ``max_cache_tokens`` (it never moves); on CPU at its first forward
        (a session that never drafts holds no KV memory at all)."""
        state = KVCache()
        if self.shared_buffer:
            if self.device == "cuda":
                self._alloc_shared(state, self.max_cache_tokens)
        else:
            empty = np.zeros((1, self.num_kv_heads, 0, self.head_size), dtype=self.kv_dtype)
            state.arrays = {past: empty for past, _ in self.kv_pairs}
        return state

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        item = 2 if self.kv_dtype is None else np.dtype(self.kv_dtype).itemsize
        return len(self.kv_pairs) * self.num_kv_heads * self.head_size * item

    @property
    def can_clone_prefix(self) -> bool:
        """Whether :meth:`clone_prefix` works here (host caches only: on CUDA
        the prefix cache is off)."""
        return self.device == "cpu"

    def held_tokens(self, state: KVCache, length: int | None = None) -> int:
        """Tokens ``state`` takes of a KV budget when it holds ``length``
        (default: what it holds now): on CUDA its preallocated buffer,
        reserved from creation; on the host what it holds."""
        n = state.length if length is None else length
        return max(state.capacity, n) if self.device == "cuda" else n

    def clone_prefix(self, src: KVCache, n: int) -> KVCache:
        """A new state holding ``src``'s first ``n`` positions (``src`` is
        left as it is). Concat mode shares the arrays (never written in
        place); a shared buffer is copied into a fresh one."""
        if not 0 < n <= src.length:
            raise ValueError(f"clone_prefix({n}) outside [1, {src.length}]")
        if not self.can_clone_prefix:
            raise ValueError("prefix reuse needs a host KV cache")
        state = KVCache()
        if self.shared_buffer:
            cap = min(self.max_cache_tokens, max(_DEFAULT_CPU_CAPACITY, 1 << (n - 1).bit_length()))
            shape = (1, self.num_kv_heads, max(cap, n), self.head_size)
            for past, _ in self.kv_pairs:
                arr = np.zeros(shape, dtype=self.kv_dtype)
                arr[:, :, :n, :] = src.shared[past][1][:, :, :n, :]  # type: ignore[index]
                state.shared[past] = (ort.OrtValue.ortvalue_from_numpy(arr), arr)
            state.capacity = shape[2]
        else:
            state.arrays = {k: v[:, :, :n, :] for k, v in src.arrays.items()}
        state.length = n
        return state

    def _alloc_shared(self, state: KVCache, capacity: int) -> None:
        shape = (1, self.num_kv_heads, capacity, self.head_size)
        new: dict[str, tuple[ort.OrtValue, np.ndarray | None]] = {}
        for past, _ in self.kv_pairs:
            if self.device == "cpu":
                if self.kv_dtype is None:
                    raise ValueError("bfloat16 KV cache is not supported on CPU")
                arr = np.zeros(shape, dtype=self.kv_dtype)
                if state.shared and state.length:
                    arr[:, :, : state.length, :] = state.shared[past][1][:, :, : state.length, :]  # type: ignore[index]
                new[past] = (ort.OrtValue.ortvalue_from_numpy(arr), arr)
            else:
                if state.shared:
                    raise RuntimeError(f"KV cache is full ({state.capacity} tokens)")
                elem: Any = self.kv_dtype if self.kv_dtype is not None else 16  # onnx BFLOAT16
                new[past] = (ort.OrtValue.ortvalue_from_shape_and_type(shape, elem, "cuda", 0), None)
        state.shared = new
        state.capacity = capacity

    def _ensure_capacity(self, state: KVCache, needed: int) -> None:
        if needed > self.max_cache_tokens:
            raise ValueError(f"context of {needed} tokens exceeds the cache limit {self.max_cache_tokens}")
        if needed <= state.capacity:
            return
        cap = max(state.capacity, min(_DEFAULT_CPU_CAPACITY, self.max_cache_tokens))
        while cap < needed:
            cap *= 2
        self._alloc_shared(state, min(cap, self.max_cache_tokens))

    # ---------------------------------------------------------------- forward

    def forward(self, state: KVCache, input_ids: Sequence[int]) -> np.ndarray:
        """Appends ``input_ids`` (S >= 1) to the cache and returns float32
        logits [S, V] (or [1, V] for the last position when the graph's LM
        head is pruned, see ``all_logits``)."""
        s = len(input_ids)
        if s == 0:
            raise ValueError("forward needs at least one token")
        past_len = state.length
        total = past_len + s
        feeds: dict[str, np.ndarray] = {"input_ids": np.asarray([input_ids], dtype=self.ids_dtype)}
        if self.has_attention_mask:
            feeds["attention_mask"] = np.ones((1, total), dtype=np.int64)
        if self.has_position_ids:
            feeds["position_ids"] = np.arange(past_len, total, dtype=np.int64)[None, :]
        if self.shared_buffer:
            self._ensure_capacity(state, total)
            io = self.session.io_binding()
            for name, value in feeds.items():
                io.bind_cpu_input(name, value)
            io.bind_output("logits")
            for past, present in self.kv_pairs:
                ov = state.shared[past][0]
                io.bind_ortvalue_input(past, ov)
                io.bind_ortvalue_output(present, ov)
            self.session.run_with_iobinding(io)
            logits = io.get_outputs()[0].numpy()
        else:
            for past, _ in self.kv_pairs:
                feeds[past] = state.arrays[past]
            names = ["logits"] + [present for _, present in self.kv_pairs]
            out = self.session.run(names, feeds)
            logits = out[0]
            state.arrays = {past: arr for (past, _), arr in zip(self.kv_pairs, out[1:])}
        state.length = total
        return np.asarray(logits[0], dtype=np.float32)  # [S or 1, V]


def _op_types(path: Path) -> set[str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {n.op_type for n in model.graph.node}


def _read_meta(model_dir: Path) -> dict[str, Any]:
    """Sizes the graph may leave symbolic: from genai_config.json, else config.json."""
    meta: dict[str, Any] = {}
    genai = model_dir / "genai_config.json"
    if genai.is_file():
        m = json.loads(genai.read_text())["model"]
        dec = m.get("decoder", {})
        meta.update(
            head_size=dec.get("head_size"),
            num_kv_heads=dec.get("num_key_value_heads"),
            vocab_size=m.get("vocab_size"),
            context_length=m.get("context_length"),
        )
        eos = m.get("eos_token_id")
        meta["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos or [])
    cfg = model_dir / "config.json"
    if cfg.is_file():
        c = json.loads(cfg.read_text())
        heads = c.get("num_attention_heads")
        meta.setdefault("head_size", c.get("head_dim") or (c["hidden_size"] // heads if heads else None))
        meta.setdefault("num_kv_heads", c.get("num_key_value_heads", heads))
        meta.setdefault("vocab_size", c.get("vocab_size"))
        meta.setdefault("context_length", c.get("max_position_embeddings"))
        if "eos_token_ids" not in meta:
            eos = c.get("eos_token_id")
            meta["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos or [])
    return meta
