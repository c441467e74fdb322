"""Q4_K / Q6_K GGUF files for tiny test models (test-only).

``quantize_q4_k`` / ``quantize_q6_k`` write real K-quant blocks (the layouts
of ggml-common.h, checked against ``gguf.quants.dequantize`` in the tests)
with a plain min/max quantizer: not llama.cpp's search for the best scales,
but every block is a valid block of its type. ``quantize_tiny_model`` turns a
tiny HF model (tests/tiny.py) into the pair a user's GGUF becomes: a GGUF
whose linear layers are quantized blocks, and an HF directory holding their
exact float32 dequantization (what specdec's GGUF conversion produces).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K a multiple of 256) -> Q4_K blocks [N, K/256 * 144] uint8."""
    n, k = w.shape
    b = w.reshape(-1, 8, 32).astype(np.float32)  # super-blocks x sub-blocks x weights
    lo = np.minimum(b.min(-1), 0.0)
    scale = (b.max(-1) - lo) / 15.0
    mins = -lo
    d = np.maximum(scale.max(-1), 1e-8) / 63.0
    dmin = np.maximum(mins.max(-1), 1e-8) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(mins / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    s = d16.astype(np.float32)[:, None] * sc
    m = dmin16.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((b + m[..., None]) / s[..., None]), 0, 15).astype(np.uint8).reshape(-1, 256)
    packed = np.zeros((b.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    qc = q.reshape(-1, 4, 2, 32)
    qs = (qc[:, :, 0] | (qc[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16(d16), _f16(dmin16), packed, qs], axis=1)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K a multiple of 256) -> Q6_K blocks [N, K/256 * 210] uint8."""
    n, k = w.shape
    b = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.maximum(np.abs(b).max(-1), 1e-8) / 31.0
    d = scale.max(-1) / 127.0
    d16 = d.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    s = d16.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(b / s[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low, high = q & 15, q >> 4
    ql = (low[:, :, 0:64] | (low[:, :, 64:128] << 4)).reshape(-1, 128)
    hh = high.reshape(-1, 2, 4, 32)
    qh = (hh[:, :, 0] | (hh[:, :, 1] << 2) | (hh[:, :, 2] << 4) | (hh[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d16)], axis=1)
    return blocks.reshape(n, -1)


#: HF linear name suffix -> GGUF name, as target_service.quant maps them
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def quantize_tiny_model(hf_dir: Path | str, gguf_path: Path | str, q6_layers: tuple[str, ...] = ("mlp.down_proj",
                        "self_attn.v_proj", "lm_head"), embedding: str | None = "Q4_K") -> Path:
    """Quantizes every linear layer of the HF model at ``hf_dir`` (dims
    multiples of 256) into ``gguf_path`` (Q6_K for names ending in one of
    ``q6_layers``, Q4_K otherwise), and the input embedding as
    ``token_embd.weight`` in ``embedding`` (None: not written, as in a file
    that lacks it), and overwrites the HF weights with the exact float32
    dequantization of those blocks. Returns ``gguf_path``."""
    import gguf
    import torch
    from transformers import Qwen2ForCausalLM

    from specdec.models.gguf_blocks import decode

    model = Qwen2ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    writer = gguf.GGUFWriter(str(gguf_path), "qwen2")
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            w = mod.weight.detach().numpy()
            kind = "Q6_K" if name.endswith(q6_layers) else "Q4_K"
            blocks = (quantize_q6_k if kind == "Q6_K" else quantize_q4_k)(w)
            if name == "lm_head":
                gname = "output.weight"
            else:
                layer = name.split(".")[2]
                suffix = ".".join(name.split(".")[3:])
                gname = f"blk.{layer}.{_NAMES[suffix]}.weight"
            writer.add_tensor(gname, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
            mod.weight.copy_(torch.from_numpy(decode(blocks, kind, *w.shape).dequantize()))
        if embedding is not None:
            emb = model.get_input_embeddings().weight
            w = emb.detach().numpy()
            blocks = (quantize_q6_k if embedding == "Q6_K" else quantize_q4_k)(w)
            writer.add_tensor("token_embd.weight", blocks, raw_dtype=gguf.GGMLQuantizationType[embedding])
            emb.copy_(torch.from_numpy(decode(blocks, embedding, *w.shape).dequantize()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.save_pretrained(str(hf_dir), safe_serialization=True)
    return Path(gguf_path)
