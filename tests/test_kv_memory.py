"""The target's memory against the KV it counts (issue 26's chat soak: the
target's RSS doubled while its KV manager counted 0.75 GiB).

Found (scripts/kv_rss_probe.py): the storages the sessions and the prefix
cache keep alive were exactly what the KV manager counts, so no view kept a
larger tensor alive; the growth was (1) a batched forward copying every
session's cache into one padded batch, all layers at once, before the
model ran (as large as all their KV again, and growing with the longest
history), and (2) glibc keeping what those copies freed in its heap. The
runner now pads one layer at a time (kv_adapter.RowsLayer) and the engine
hands free heap pages back between batches (specdec/memory.py).

On tiny random models: the heap in use while a batched forward runs, with
a negative control that pads every layer at once as before; the storage
behind the prefix cache's entries equals what the KV manager counts after
many batched turns with rollbacks, with a control showing that a
rolled-back layer does keep more; and malloc_trim giving freed heap back."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.memory import TrimPacer, heap_info, release_free_memory, rss_bytes, set_mmap_threshold
from specdec.sampling import SamplingConfig
from target_service import kv_adapter as kv
from target_service import runner
from target_service.calls import PrefillCall, VerifyCall
from target_service.engine import PrefillOutcome, TargetEngine, VerifyOutcome
from tests.tiny import build_tiny_model

glibc = pytest.mark.skipif(not heap_info(), reason="needs glibc's mallinfo2")

CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """8 layers, 2 KV heads of 64: a layer is 1/8 of a token's KV."""
    return build_tiny_model(tmp_path_factory.mktemp("deep") / "m", chars=CHARS, seed=4, num_layers=8, hidden_size=128,
                            num_heads=2, num_kv_heads=2, intermediate_size=64, max_position_embeddings=2048)


def _allocated() -> int:
    h = heap_info()
    return h["heap_in_use"] + h["mmapped"]


def _peak_during(model: torch.nn.Module, fn):  # type: ignore[no-untyped-def]
    """Runs ``fn`` and returns (its result, the most heap in use seen at the
    start of any decoder layer and at the end, over what was in use before)."""
    seen: list[int] = []
    hooks = [layer.register_forward_pre_hook(lambda *_: seen.append(_allocated())) for layer in model.model.layers]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda *_: seen.append(_allocated())))
    base = _allocated()
    try:
        out = fn()
    finally:
        for h in hooks:
            h.remove()
    return out, max(seen) - base


def _sessions(engine: TargetEngine, n: int, length: int) -> list:  # type: ignore[type-arg]
    rnd = random.Random(1)
    outs = [engine.prefill([rnd.randrange(1, engine.vocab_size) for _ in range(length + 7 * i)], SamplingConfig(), True)
            for i in range(n)]
    return [engine.kv.get(o.session_id) for o in outs]


@glibc
def test_a_batched_forward_holds_one_layers_padded_copy_not_every_layers(deep) -> None:  # type: ignore[no-untyped-def]
    engine = TargetEngine(deep, dtype="float32", prefix_cache=False)
    sessions = _sessions(engine, 8, 400)
    bpt = engine.kv.bytes_per_token
    live = sum(kv.storage_bytes(kv.cache_tensors(s.cache)) for s in sessions)
    assert live == sum(s.cache_len + kv.headroom(s.cache_len) for s in sessions) * bpt  # each layer's buffer
    rows = [runner.BatchRow(s.cache, [5], 1, s.cache_len) for s in sessions]
    logits, peak = _peak_during(engine.model, lambda: runner.forward_batch(engine.model, engine.device, engine._cache_kwarg, rows))
    assert len(logits) == 8
    # each session's cache now holds past + 1, written into its own buffer's headroom: nothing of the batch
    for s in sessions:
        assert kv.length(s.cache) == s.cache_len + 1
        assert kv.storage_bytes(kv.cache_tensors(s.cache)) == (s.cache_len + kv.headroom(s.cache_len)) * bpt
    # the padded copy of one layer (1/8 of the KV) plus its rows' new tensors, at most
    assert peak < 0.4 * live, (peak, live)

    # negative control: every layer padded before the model runs (the runner before this fix)
    p = max(s.cache_len for s in sessions)
    cache = kv.new_cache(engine.model.config)

    def old() -> object:
        for li in range(kv.num_layers(cache)):
            k0, v0 = kv.layer_kv(sessions[0].cache, li)
            keys = k0.new_zeros((8, k0.shape[1], p, k0.shape[3]))
            values = v0.new_zeros((8, v0.shape[1], p, v0.shape[3]))
            for i, s in enumerate(sessions):
                rk, rv = kv.layer_kv(s.cache, li)
                keys[i, :, p - s.cache_len :] = rk[0, :, : s.cache_len]
                values[i, :, p - s.cache_len :] = rv[0, :, : s.cache_len]
            kv.set_layer_kv(cache, li, keys, values)
        mask = torch.ones((8, p + 1), dtype=torch.long)
        return engine.model(input_ids=torch.full((8, 1), 5), attention_mask=mask, use_cache=True,
                            logits_to_keep=1, **{engine._cache_kwarg: cache})

    with torch.inference_mode():
        _, old_peak = _peak_during(engine.model, old)
    assert old_peak > 0.9 * live, (old_peak, live)


def test_a_failed_batched_forward_leaves_every_session_as_it_was(deep) -> None:  # type: ignore[no-untyped-def]
    engine = TargetEngine(deep, dtype="float32", prefix_cache=False)
    sessions = _sessions(engine, 3, 50)
    before = [[t.clone() for t in kv.cache_tensors(s.cache)] for s in sessions]
    boom = engine.model.model.layers[5].register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("x")))
    try:
        with pytest.raises(RuntimeError):
            runner.forward_batch(engine.model, engine.device, engine._cache_kwarg,
                                 [runner.BatchRow(s.cache, [5, 6], 1, s.cache_len) for s in sessions])
    finally:
        boom.remove()
    for s, ref in zip(sessions, before):
        assert kv.length(s.cache) == s.cache_len
        assert all(torch.equal(a, b) for a, b in zip(kv.cache_tensors(s.cache), ref))


def test_prefix_entries_hold_exactly_the_storage_the_kv_manager_counts(tiny_models) -> None:  # type: ignore[no-untyped-def]
    """12 turns of 6 chats sharing 2 system prompts, each turn a batched
    prefill of the whole conversation and 6 batched verify rounds with 3
    random drafted tokens (rolled back), then a release: the storages the
    entries keep alive are their tokens' bytes, and everything referenced is
    what the manager counts."""
    engine = TargetEngine(tiny_models.target, dtype="float32", prefix_cache=True, memory_trim_interval_s=-1)
    bpt = engine.kv.bytes_per_token
    rnd = random.Random(2)
    vocab = engine.vocab_size
    systems = [[rnd.randrange(1, vocab) for _ in range(40)] for _ in range(2)]
    convs = [list(systems[i % 2]) for i in range(6)]
    rolled_back_views = 0
    for _ in range(12):
        for c in convs:
            c.extend(rnd.randrange(1, vocab) for _ in range(6))
        state = []
        for o, _ in engine.run_batch([PrefillCall(list(c), SamplingConfig(), True) for c in convs]):
            assert isinstance(o, PrefillOutcome)
            state.append([o.session_id, o.cache_len, o.next_token])
        for _ in range(6):
            calls = [VerifyCall(sid, n, [t], [rnd.randrange(1, vocab) for _ in range(3)], [None] * 3)
                     for sid, n, t in state]
            for st, (o, _) in zip(state, engine.run_batch(calls)):
                assert isinstance(o, VerifyOutcome)
                st[1], st[2] = o.cache_len, o.result.next_token
        for st, c in zip(state, convs):
            sess = engine.kv.get(st[0])
            c[:] = list(sess.tokens)
            held = kv.storage_bytes(kv.cache_tensors(sess.cache))
            assert held >= sess.cache_len * bpt
            rolled_back_views += held > sess.cache_len * bpt  # the control: a rolled-back layer keeps more
            engine.release(st[0])
        engine.run_batch([])  # stores the released sessions
        assert engine.prefix is not None and engine.kv.num_sessions == 0
        entries = engine.prefix.entries()
        held = kv.storage_bytes(t for e in entries for kvs in e.layers for t in kvs)
        assert held == engine.kv.prefix_tokens * bpt == engine.kv.used_bytes == engine.referenced_kv_bytes()
    assert rolled_back_views > 0
    assert engine.prefix.hits_tokens > 0


@glibc
def test_malloc_trim_gives_freed_heap_back_and_the_pacer_limits_it() -> None:
    # a target server started in this process earlier fixes the mmap threshold at 256 KiB (its default), and
    # then no 1 MiB block comes from the heap: 32 MiB (glibc's largest) puts them back there
    set_mmap_threshold(32 << 20)
    big = torch.ones(1 << 21)  # an 8 MiB chunk mapped and unmapped: glibc's mmap threshold rises past 1 MiB
    del big
    release_free_memory()
    keep, drop = [], []
    for i in range(200):  # 1 MiB tensors, every other one freed: holes glibc keeps in its heap
        (keep if i % 2 else drop).append(torch.ones(1 << 18))
    del drop
    before = rss_bytes()
    pacer = TrimPacer(min_interval_s=60.0, min_free_bytes=0)
    assert pacer.maybe_trim() is True and pacer.trims == 1
    freed = before - rss_bytes()
    assert freed > 50 << 20, freed  # most of the 100 MiB freed
    assert pacer.maybe_trim() is False and pacer.trims == 1  # paced
    assert TrimPacer(min_interval_s=-1).maybe_trim() is False  # off
    assert sum(int(t[0]) for t in keep) == 100


_HOLES = """
import sys, torch
from specdec.memory import rss_bytes, set_mmap_threshold
if sys.argv[1] == "fixed":
    assert set_mmap_threshold(256 << 10)
big = torch.ones(1 << 21)  # an 8 MiB block freed: glibc's dynamic threshold rises past 1 MiB
del big
keep, drop = [], []
for i in range(200):  # 1 MiB tensors, every other one freed
    (keep if i % 2 else drop).append(torch.ones(1 << 18))
before = rss_bytes()
del drop
print((before - rss_bytes()) >> 20)
"""


@glibc
@pytest.mark.parametrize("threshold", ["fixed", "dynamic"])
def test_a_fixed_mmap_threshold_returns_freed_blocks_at_once(threshold: str) -> None:
    """With the services' default (``--memory-mmap-threshold``, 256 KiB),
    freeing a large tensor gives its pages back at once, without a trim, so
    RSS between two trims follows what is live. The control, glibc's
    dynamic threshold, keeps the freed blocks as holes in its heap. Each
    case runs in a process of its own (the setting is process-wide)."""
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", _HOLES, threshold], capture_output=True, text=True, timeout=120,
                         cwd=repo, env={"PYTHONPATH": repo, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    freed_mib = int(out.stdout.split()[-1])
    if threshold == "fixed":
        assert freed_mib >= 90, freed_mib  # the 100 MiB freed
    else:
        assert freed_mib < 20, freed_mib


@pytest.mark.parametrize("service", ["target", "draft"])
def test_the_mmap_threshold_flag_is_checked_before_start(service: str) -> None:
    """Both model services take it (the draft's KV buffers grow by doubling:
    with a fixed threshold their unwritten capacity is never resident and a
    freed one leaves RSS at once), checked through `serve` and through `up`."""
    import importlib

    from specdec_app.cli import build_parser

    config_from_args = importlib.import_module(f"{service}_service.cli").config_from_args

    def config(*flags: str):  # type: ignore[no-untyped-def]
        return config_from_args(build_parser().parse_args(["serve", service, *flags]), 0)

    assert config().memory_mmap_threshold_bytes == 256 << 10
    assert config("--memory-mmap-threshold", "0").memory_mmap_threshold_bytes == 0
    with pytest.raises(SystemExit, match="specdec: --memory-mmap-threshold must be in"):
        config("--memory-mmap-threshold", str(64 << 20))
    up = build_parser().parse_args(["up", f"--{service}-memory-mmap-threshold", "-1"])
    with pytest.raises(SystemExit, match=f"specdec: --{service}-memory-mmap-threshold must be in"):
        config_from_args(up, 0)
