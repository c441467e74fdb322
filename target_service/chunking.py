"""How many prompt tokens the next prefill chunk takes. Plain Python.

A long prompt is prefilled in chunks so that other sessions' rounds run
between them (target_service/engine.py). On a CPU a forward's cost grows
about linearly with its tokens, so a co-tenant stream waits for a whole
chunk: 256 tokens is about 1.5 s on the 2-core machines of issue 26,
against a 30–90 ms decode step. While another session is decoding, the
chunk is therefore cut to cost about ``share`` of its decode steps, from
forward times measured online (an EWMA of decode-sized forwards, and of
prefill forwards per token): the co-tenant's longest gap is then about
(1 + share) steps. With nobody else decoding, the chunk is the full
``chunk_tokens``, the efficient size.
"""

from __future__ import annotations

MIN_CHUNK = 4  # below this a forward costs nearly a full step for almost no prompt
# another session counts as decoding when it was used within this long, and at least
# ACTIVE_FORWARDS of the last forward's time: its rounds come one forward apart, so on a
# slow or contended machine, where a forward outlasts a second, a fixed 1 s window lost
# sight of a busy stream, chunks went back to full size, and that stream starved (a
# 4,000-token prompt beside one: 47 s gaps, then 120 s without a Verify reply)
ACTIVE_WINDOW_S = 1.0
ACTIVE_FORWARDS = 3.0


class ChunkSizer:
    def __init__(self, chunk_tokens: int, share: float) -> None:
        self.chunk_tokens = chunk_tokens
        self.share = share
        self.step_ms = 0.0  # EWMA of a decode-sized forward (verify rows only, <= 8 tokens)
        self.prefill_ms_per_token = 0.0  # EWMA of a prefill forward's time per token
        self.last_ms = 0.0  # the last forward's time, whatever it served

    def observe(self, *, decode: bool, prefill: bool, tokens: int, ms: float) -> None:
        """One forward's time: ``decode`` for a decode-sized verify batch,
        ``prefill`` for a lone prefill row (a chunk, or a prompt of >= 16 tokens)."""
        self.last_ms = ms
        if decode and tokens <= 8:
            self.step_ms = ms if not self.step_ms else 0.8 * self.step_ms + 0.2 * ms
        elif prefill and tokens:
            per = ms / tokens
            self.prefill_ms_per_token = per if not self.prefill_ms_per_token else (
                0.5 * self.prefill_ms_per_token + 0.5 * per)

    def active_window_s(self) -> float:
        """How recently another session must have been used to count as
        decoding beside a chunked prefill: ACTIVE_WINDOW_S, or
        ACTIVE_FORWARDS forwards' time when forwards are slower."""
        return max(ACTIVE_WINDOW_S, ACTIVE_FORWARDS * self.last_ms / 1e3)

    def size(self, others_decoding: bool) -> int:
        """The next chunk's tokens (0 = no chunking)."""
        chunk = self.chunk_tokens
        if not chunk or self.share <= 0 or not others_decoding or not self.step_ms or not self.prefill_ms_per_token:
            return chunk
        return max(MIN_CHUNK, min(chunk, int(self.share * self.step_ms / self.prefill_ms_per_token)))
