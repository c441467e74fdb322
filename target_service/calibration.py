"""Start-up calibration of the target: measure the forward cost t(k) of each
eligible (dtype, backend) pair on this machine and keep the pair that serves
speculative decoding fastest. Plain Python, no gRPC.

The choice rule (docs/architecture.md, "Choosing the target's numerics"):
for each pair and each acceptance level α of ``ACCEPTANCE_MIX``, the best
expected throughput the adaptive policy could reach,

    R(α) = max over γ in 0..γ_max of  E_α(γ) / (t(γ + 1) + γ · d),

with E_α(γ) = (1 − α^(γ+1)) / (1 − α) committed tokens per round, t the
pair's measured curve (t(1) is plain decoding, γ = 0), and d the draft's cost
per token, taken as ``DRAFT_RATIO`` × the fastest t(1) of all pairs (the
draft does not depend on the target's numerics). A pair's score is the mean
of R(α) over the mix: the throughput a stream of requests with those
acceptance levels sees on average. Low levels are in the mix on purpose: a
pair whose single step is slow pays for it on every request the policy
decides not to speculate on.

``pick_pair`` is pure; ``measure_curve`` times a model; ``CalibrationCache``
keeps results per machine and model.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Mapping, Sequence

if TYPE_CHECKING:
    import torch

from specdec.logging_util import log
from target_service.calibration_cache import CalibrationCache, Curve, Measured, Pair, machine_identity, pair_key

logger = logging.getLogger("specdec.target")

# 6 and 8 straddle the bf16w kernel's step (a pass of up to six rows reads
# each weight once, seven take a second group): without 6, interpolating
# between 4 and 8 hides the cheap k = 5..6 the policy should aim for
CALIBRATION_KS = (1, 2, 4, 6, 8, 16)
CALIBRATION_KV = 128  # tokens of KV cache behind the measured pass (a short prompt)
ACCEPTANCE_MIX = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9)
DRAFT_RATIO = 0.1  # draft cost per token / the fastest target step
GAMMA_MAX = 8


def interpolate(curve: Mapping[int, float], k: float) -> float:
    """t(k) from a measured curve: piecewise linear between measured k,
    extrapolated with the last segment's slope past the largest k and flat
    below the smallest."""
    ks = sorted(curve)
    if not ks:
        raise ValueError("empty cost curve")
    if k <= ks[0]:
        return float(curve[ks[0]])
    for lo, hi in zip(ks, ks[1:]):
        if k <= hi:
            return float(curve[lo] + (curve[hi] - curve[lo]) * (k - lo) / (hi - lo))
    if len(ks) == 1:
        return float(curve[ks[0]])
    lo, hi = ks[-2], ks[-1]
    slope = max(0.0, (curve[hi] - curve[lo]) / (hi - lo))
    return float(curve[hi] + slope * (k - hi))


def expected_committed(alpha: float, gamma: int) -> float:
    """E_α(γ): tokens committed per round with i.i.d. acceptance α."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_rate(curve: Mapping[int, float], alpha: float, draft_ms: float, gamma_max: int = GAMMA_MAX) -> tuple[float, int]:
    """(tokens per second, γ) of the best round shape at acceptance ``alpha``."""
    best, best_g = 0.0, 0
    for g in range(gamma_max + 1):
        rate = 1000.0 * expected_committed(alpha, g) / (interpolate(curve, g + 1) + g * draft_ms)
        if rate > best:
            best, best_g = rate, g
    return best, best_g


@dataclass(frozen=True)
class Choice:
    pair: Pair
    scores: dict[Pair, float]  # mean tokens/s over the acceptance mix
    draft_ms: float


def pick_pair(
    curves: Mapping[Pair, Mapping[int, float]],
    mix: Sequence[float] = ACCEPTANCE_MIX,
    draft_ratio: float = DRAFT_RATIO,
    gamma_max: int = GAMMA_MAX,
    admissible: Collection[Pair] | None = None,
) -> Choice:
    """The pair with the highest mean expected throughput over ``mix``
    (ties: the earlier pair in ``curves``), among ``admissible`` (None: all;
    every pair is scored either way)."""
    if not curves:
        raise ValueError("no calibrated pairs to choose from")
    draft_ms = draft_ratio * min(interpolate(c, 1) for c in curves.values())
    scores = {
        pair: statistics.fmean(best_rate(c, a, draft_ms, gamma_max)[0] for a in mix) for pair, c in curves.items()
    }
    allowed = [p for p in curves if admissible is None or p in admissible]
    if not allowed:
        raise ValueError("no admissible pair to choose from")
    best = max(allowed, key=lambda p: scores[p])
    return Choice(best, scores, draft_ms)


def plain_bf16(pairs: Sequence[Pair]) -> list[Pair]:
    """The non-quantized bf16 pairs: the bound's reference where bf16 eager is not one."""
    from target_service.backends import QUANT_BACKENDS

    return [p for p in pairs if p[0] == "bfloat16" and p[1] not in QUANT_BACKENDS]


def fidelity_reference(pairs: Sequence[Pair], fidelity: Mapping[Pair, Mapping[str, object]]) -> tuple[Pair, Mapping[str, object]] | None:
    """The pair whose fidelity bounds the quantized pairs': ``bfloat16/eager``,
    transformers' own bf16 computation of the same file (the numerics ``auto``
    admits without any check, and what a bf16 deployment of this checkpoint
    computes). Where it was not measured, the most faithful non-quantized bf16
    pair (the stricter bound); None when no bf16 pair was measured."""
    if ("bfloat16", "eager") in fidelity and ("bfloat16", "eager") in pairs:
        return ("bfloat16", "eager"), fidelity[("bfloat16", "eager")]
    bf16 = [p for p in plain_bf16(pairs) if p in fidelity]
    if not bf16:
        return None
    best = min(bf16, key=lambda p: float(fidelity[p]["mean_kl"]))  # type: ignore[arg-type]
    return best, fidelity[best]


def fidelity_admissible(pairs: Sequence[Pair], fidelity: Mapping[Pair, Mapping[str, object]]) -> tuple[list[Pair], dict[Pair, str]]:
    """The pairs ``auto`` may choose: every non-quantized pair, and each
    quantized one whose measured fidelity is within the bound of the
    reference bf16 pair's (:func:`fidelity_reference`,
    ``target_service.fidelity.within_bound``); the others with the reason
    they are left out."""
    from target_service.backends import QUANT_BACKENDS
    from target_service.fidelity import within_bound

    ref = fidelity_reference(pairs, fidelity)
    ok, out = [], {}
    for p in pairs:
        if p[1] not in QUANT_BACKENDS:
            ok.append(p)
        elif p not in fidelity or ref is None:
            out[p] = "its fidelity against the exact dequantization was not measured"
        elif not within_bound(dict(fidelity[p]), dict(ref[1])):
            out[p] = (f"mean KL {float(fidelity[p]['mean_kl']):.2e} / top-1 {float(fidelity[p]['top1_agreement']):.4f} "
                      f"is outside the bound of {pair_key(ref[0])}'s ({float(ref[1]['mean_kl']):.2e} / "
                      f"{float(ref[1]['top1_agreement']):.4f})")
        else:
            ok.append(p)
    return ok, out


def measure_curve(
    forward: Callable[[int], None],
    reset: Callable[[], None],
    ks: Sequence[int] = CALIBRATION_KS,
    reps: int = 5,
    budget_s: float = 30.0,
) -> Curve:
    """Median wall time (ms) of ``forward(k)`` for each k, ``reset()`` after
    every pass (untimed). One untimed pass first per k (kernels, allocator),
    then up to ``reps`` rounds, each timing every k in turn; no new round
    starts once ``budget_s`` has passed (one round at least).

    Rounds, not k after k: a VM's speed drifts by up to 2x within the hour,
    and timed k after k a slow spell lands on some k's only and bends the
    curve's shape, t(k)/t(1), by which the orchestrator prices a span before
    it has seen one (measured on Zen 4: t(8) = 5.5 t(1) k after k in one
    calibration, 2.2-2.9 t(1) in rounds, four times running). In rounds a
    slow spell slows every k alike, and the median drops it."""
    for k in ks:
        forward(k)
        reset()
    times: dict[int, list[float]] = {k: [] for k in ks}
    t_start = time.perf_counter()
    for r in range(max(1, reps)):
        if r and time.perf_counter() - t_start >= budget_s:
            break
        for k in ks:
            t0 = time.perf_counter()
            forward(k)
            times[k].append((time.perf_counter() - t0) * 1000.0)
            reset()
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


@dataclass
class CalibrationResult:
    """What the target reports and logs: every measured pair's curve and the
    choice among them."""

    dtype: str
    backend: str
    curves: dict[str, Curve] = field(default_factory=dict)  # "dtype/backend" -> curve
    scores: dict[str, float] = field(default_factory=dict)  # "dtype/backend" -> mean tokens/s
    draft_ms: float = 0.0
    chosen_by: str = "calibration"  # calibration | flags | device
    cached: bool = False
    seconds: float = 0.0
    # "dtype/backend" -> target_service.fidelity.Fidelity as a dict (measured
    # when a quantized pair is a candidate), and why pairs were not admissible
    fidelity: dict[str, dict[str, object]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    # quantized pairs whose fidelity was not scored: slower than the choice
    unscored: list[str] = field(default_factory=list)
    # "dtype/backend" -> kernel settings chosen by timing with the curve
    # (kquant: {"prefetch": distance, "ms": ...}); the chosen pair's are in force
    tuning: dict[str, dict[str, object]] = field(default_factory=dict)

    @property
    def curve(self) -> Curve:
        return self.curves.get(pair_key((self.dtype, self.backend)), {})

    def table(self) -> str:
        """The curves as text lines (logs, docs)."""
        ks = sorted({k for c in self.curves.values() for k in c})
        lines = ["pair               " + " ".join(f"k={k:<6}" for k in ks) + "  score tok/s"
                 + ("  mean KL   top-1" if self.fidelity else "")]
        for key, c in self.curves.items():
            mark = "*" if key == pair_key((self.dtype, self.backend)) else " "
            cells = " ".join(f"{c.get(k, float('nan')):<8.1f}" for k in ks)
            fid = self.fidelity.get(key)
            tail = f"  {float(fid['mean_kl']):.2e}  {float(fid['top1_agreement']):.4f}" if fid else ""
            if key in self.excluded:
                tail += "  (not admissible)"
            lines.append(f"{mark}{key:<18}{cells}  {self.scores.get(key, 0.0):.2f}{tail}")
        return "\n".join(lines)


#: the order in which quantized pairs are timed: the one that is usually
#: fastest first, so that a slower one's fidelity need not be scored
QUANT_MEASURE_ORDER = ("kquant-a8", "kquant", "int4", "int4-q8")


def reference_to_score(pairs: Sequence[Pair], fidelity: Mapping[Pair, object], unscorable: Collection[Pair]) -> list[Pair]:
    """The pairs still to score for :func:`fidelity_reference`: bf16 eager,
    or where it is not a candidate (or cannot be scored) the other
    non-quantized bf16 pairs."""
    if ("bfloat16", "eager") in pairs and ("bfloat16", "eager") not in unscorable:
        return [] if ("bfloat16", "eager") in fidelity else [("bfloat16", "eager")]
    return [p for p in plain_bf16(pairs) if p not in fidelity and p not in unscorable]


def choose(
    pairs: Sequence[Pair],
    measure: Callable[[Pair], Measured],
    cache: "CalibrationCache | None" = None,
    fidelity_needed: bool = False,
    tunings: "dict[Pair, dict[str, object]] | None" = None,
    measure_fidelity: "Callable[[Pair], dict[str, object] | None] | None" = None,
) -> CalibrationResult:
    """Measures every pair's curve (or takes it from ``cache``) and picks one.
    ``tunings``: the kernel settings ``measure`` chose per pair (it fills the
    dict); they are cached with the curve and come back from the cache.

    With ``fidelity_needed`` (a quantized pair is a candidate), the quantized
    pairs outside the fidelity bound are not admissible
    (:func:`fidelity_admissible`). A fidelity costs a teacher-forced pass
    over the calibration sample, the longest part of a first start on a CPU
    without native bf16, so it is scored (``measure_fidelity``) only where
    it decides the choice: for a quantized pair that would beat every pair
    admissible so far, right after its curve (its model is still loaded),
    and for the bound's reference pair when such a pair needs it. A quantized
    pair slower than the choice is never scored; nor is a non-quantized pair
    other than the reference and the chosen one, which is reported with
    its fidelity (``specdec fidelity`` scores them all). A fidelity
    ``measure`` returns is taken as measured."""
    from target_service.backends import QUANT_BACKENDS

    t0 = time.perf_counter()
    curves: dict[Pair, Curve] = {}
    fidelity: dict[Pair, dict[str, object]] = {}
    unscorable: set[Pair] = set()
    cached_all = True

    def ordered() -> dict[Pair, Curve]:  # pick_pair breaks ties by this order
        return {p: curves[p] for p in pairs if p in curves}

    def score(pair: Pair) -> None:
        nonlocal cached_all
        if pair in fidelity or pair in unscorable or measure_fidelity is None:
            return
        cached_all = False
        log(logger, logging.INFO, "scoring fidelity", dtype=pair[0], backend=pair[1])
        got = measure_fidelity(pair)
        if got is None:
            unscorable.add(pair)
            return
        fidelity[pair] = got
        if cache is not None:
            cache.put(pair, curves[pair], got)

    def timing_order(p: Pair) -> tuple[bool, int]:  # plain pairs first, then QUANT_MEASURE_ORDER
        quant = p[1] in QUANT_BACKENDS
        return quant, (QUANT_MEASURE_ORDER.index(p[1]) if p[1] in QUANT_MEASURE_ORDER else len(QUANT_MEASURE_ORDER))

    for pair in sorted(pairs, key=timing_order):
        got = cache.get_entry(pair) if cache is not None else None
        if got is None:
            cached_all = False
            log(logger, logging.INFO, "calibrating target", dtype=pair[0], backend=pair[1])
            got = measure(pair)
            if cache is not None:
                cache.put(pair, got[0], got[1], (tunings or {}).get(pair))
        elif tunings is not None and cache is not None:
            tunings[pair] = cache.get_tuning(pair)
        curves[pair] = got[0]
        if got[1] is not None:
            fidelity[pair] = got[1]
        if fidelity_needed and pair[1] in QUANT_BACKENDS and pair not in fidelity:
            scores = pick_pair(ordered()).scores
            bar = max((s for p, s in scores.items() if p[1] not in QUANT_BACKENDS or p in fidelity), default=0.0)
            if scores[pair] > bar:
                score(pair)

    while True:
        admissible, excluded = (fidelity_admissible(pairs, fidelity) if fidelity_needed else (list(pairs), {}))
        choice = pick_pair(ordered(), admissible=admissible)  # one pair: that pair
        if measure_fidelity is None:
            break
        faster = sorted((p for p in excluded if p not in unscorable and choice.scores[p] > choice.scores[choice.pair]),
                        key=lambda p: -choice.scores[p])
        refs = reference_to_score(pairs, fidelity, unscorable) if faster else []
        todo = refs or [p for p in faster if p not in fidelity][:1]
        if not todo:  # nothing faster, or scored and outside the bound
            break
        for p in todo:
            score(p)
    if fidelity_needed and choice.pair[1] not in QUANT_BACKENDS:
        score(choice.pair)  # reported with the numerics (GetModelInfo, bench)
    unscored = [p for p in excluded if p not in fidelity and p not in unscorable and measure_fidelity is not None]
    excluded = {p: why for p, why in excluded.items() if p not in unscored}
    if excluded:
        log(logger, logging.WARNING, "quantized numerics not admissible for auto",
            pairs={pair_key(p): why for p, why in excluded.items()})
    dtype, backend = choice.pair
    return CalibrationResult(
        dtype=dtype,
        backend=backend,
        curves={pair_key(p): c for p, c in ordered().items()},
        scores={pair_key(p): round(s, 3) for p, s in choice.scores.items()},
        draft_ms=round(choice.draft_ms, 3),
        cached=cached_all,
        seconds=round(time.perf_counter() - t0, 2),
        fidelity={pair_key(p): f for p, f in fidelity.items()},
        excluded={pair_key(p): why for p, why in excluded.items()},
        tuning={pair_key(p): t for p, t in (tunings or {}).items() if t},
        unscored=[pair_key(p) for p in unscored],
    )


# ------------------------------------------------------------- start-up
def resolve_pairs(dtype: str, backend: str, device: "torch.device",
                  gguf_path: Path | None = None, need_file: bool = True) -> tuple[list[Pair], str]:
    """The (dtype, backend) pairs to calibrate for the flags given, and how
    the pair is chosen: ``flags`` when both are explicit (explicit values
    always win), else ``calibration`` among the eligible pairs that agree
    with whichever flag is explicit. ValueError for a pair this device
    cannot run (``need_file=False``: before the model is resolved, a
    quantized backend is checked against the CPU only)."""
    from target_service.backends import BACKENDS, DTYPES, QUANT_BACKENDS, eligible_pairs, packed_supported

    if backend in QUANT_BACKENDS:  # one dtype: bf16 activations
        if dtype not in ("auto", "bfloat16"):
            raise ValueError(f"--target-backend {backend} runs bfloat16 activations (asked for {dtype})")
        from target_service import quant

        ok, why = quant.supported(backend, device, gguf_path) if need_file else quant.cpu_supported(backend, device)
        if not ok:
            raise ValueError(f"--target-backend {backend} cannot run here: {why}")
        return [("bfloat16", backend)], "flags"

    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"unknown target dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown target backend {backend!r}; choose auto or one of {', '.join(BACKENDS)}")
    if dtype != "auto" and backend != "auto":
        if backend == "bf16w":
            import torch

            from target_service.backends import bf16w_supported

            if not bf16w_supported(getattr(torch, dtype), device):
                from target_service import bf16w

                why = bf16w.available()[1] or f"it runs bfloat16 weights on a CPU, not {dtype} on {device}"
                raise ValueError(f"--target-backend bf16w cannot run {dtype} on {device}: {why}")
        if backend == "packed":
            import torch

            if not packed_supported(getattr(torch, dtype), device):
                from target_service.backends import cpu_info

                where = "a CPU" if device.type != "cpu" else f"this CPU ({cpu_info().isa})"
                raise ValueError(
                    f"--target-backend packed cannot run {dtype} on {device}: it needs {where} with a native "
                    f"oneDNN {dtype} GEMM; use float32 or --target-backend eager"
                )
        return [(dtype, backend)], "flags"
    pairs = [p for p in eligible_pairs(device, gguf_path) if dtype in ("auto", p[0]) and backend in ("auto", p[1])]
    if not pairs:  # e.g. float16 on a CPU: only eager runs it
        if backend == "packed":
            raise ValueError(f"--target-backend packed has no eligible dtype on {device}")
        pairs = [(dtype if dtype != "auto" else "float32", "eager")]
    return pairs, ("calibration" if len(pairs) > 1 else ("device" if dtype == backend == "auto" else "flags"))


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def checkpoint_bytes(hf_dir: Path) -> int:
    return sum(f.stat().st_size for f in Path(hf_dir).glob("*.safetensors"))


def available_memory_bytes() -> int:
    """What this process may still allocate: the cgroup's limit minus its use
    (containers), else MemAvailable; 0 when unknown."""
    out = 0
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            out = max(0, int(limit) - used)
    except (OSError, ValueError):
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                out = min(out, avail) if out else avail
                break
    except (OSError, ValueError, IndexError):
        pass
    return out


#: tokens of the fidelity corpus scored at calibration (the
#: ``specdec fidelity`` command scores 2,048 and more)
CALIBRATION_FIDELITY_TOKENS = 1024
#: tokens per teacher-forced pass of that sample (as ``specdec fidelity``)
CALIBRATION_FIDELITY_WINDOW = 512


#: the backends whose kernel takes a setting chosen by timing (kquant.tune_prefetch)
KQUANT_BACKENDS = ("kquant", "kquant-a8")


def apply_tuning(backend: str, tuning: Mapping[str, object]) -> None:
    """Puts the kernel settings chosen with ``backend``'s curve in force
    (the kernel's defaults where none were measured: explicit flags without
    calibration, or another backend)."""
    if backend not in KQUANT_BACKENDS:
        return
    from target_service import kquant

    kquant.set_prefetch(int(tuning.get("prefetch", kquant.DEFAULT_PREFETCH)))  # type: ignore[call-overload]


def calibrate(
    hf_dir: Path,
    dtype: str,
    backend: str,
    device: "torch.device",
    cache_root: Path | None,
    model_name: str,
    measure: bool = True,
    budget_s: float = 30.0,
    gguf_path: Path | None = None,
) -> tuple[CalibrationResult, "torch.nn.Module | None"]:
    """Runs start-up calibration. Returns the result and, when it could be
    kept, the chosen pair's loaded model (None: load it). With
    ``measure=False`` and an explicit pair, nothing is timed and the result
    has no curve. When a quantized pair is a candidate for an automatic
    choice, fidelity against ``float32/eager`` is scored
    (:data:`CALIBRATION_FIDELITY_TOKENS` tokens) where it decides the choice
    (:func:`choose`), and a quantized pair is chosen only within the bound
    (target_service/fidelity.py)."""
    import gc

    from target_service.backends import QUANT_BACKENDS
    from target_service.loading import load_model, measure_forward_curve, parse_dtype

    pairs, how = resolve_pairs(dtype, backend, device, gguf_path)
    if not measure:
        if len(pairs) > 1:
            pairs = pairs[:1]  # no measurement: the first eligible pair (bf16 eager on CPU)
            how = "default"
        return CalibrationResult(pairs[0][0], pairs[0][1], chosen_by=how), None
    cache = None
    if cache_root is not None:
        cache = CalibrationCache(
            cache_root,
            {**machine_identity(device), "model": model_name, "hf_dir": str(hf_dir),
             "gguf": str(gguf_path or ""), "ks": list(CALIBRATION_KS), "kv": CALIBRATION_KV,
             "fidelity_tokens": CALIBRATION_FIDELITY_TOKENS, "fidelity_window": CALIBRATION_FIDELITY_WINDOW},
        )
    kept: dict[str, object] = {}

    available = available_memory_bytes()
    checkpoint = checkpoint_bytes(hf_dir)  # float32 safetensors on disk
    # the quantized backends load the float32 checkpoint before replacing its linear layers
    fitting = [p for p in pairs if not available
               or checkpoint * (4 if p[1] in QUANT_BACKENDS else _BYTES[p[0]]) / 4 * 1.15 < available]
    if len(fitting) < len(pairs):
        log(logger, logging.WARNING, "pairs skipped: the model would not fit this process's memory",
            skipped=[pair_key(p) for p in pairs if p not in fitting], available_gb=round(available / 2**30, 1))
        if not fitting:
            raise ValueError(f"no dtype fits the {available / 2**30:.1f} GiB this process may use "
                             f"(the float32 checkpoint is {checkpoint / 2**30:.1f} GiB)")
        pairs = fitting

    fidelity_needed = len(pairs) > 1 and any(p[1] in QUANT_BACKENDS for p in pairs)
    reference: dict[str, object] = {}

    def ensure_reference(model: "torch.nn.Module | None") -> None:
        """Reference log-probs of the fidelity sample from float32/eager
        (``model`` when it is that pair, else loaded for it)."""
        if reference:
            return
        from transformers import AutoTokenizer

        from target_service import fidelity

        ids, digest = fidelity.corpus_ids(AutoTokenizer.from_pretrained(str(hf_dir)), CALIBRATION_FIDELITY_TOKENS)
        ref_model = model if model is not None else load_model(hf_dir, parse_dtype("float32"), "eager", device, model_name)
        reference["ids"], reference["digest"] = ids, digest
        reference["logprobs"] = fidelity.reference_logprobs(fidelity.model_forward(ref_model), ids,
                                                             CALIBRATION_FIDELITY_WINDOW)
        del ref_model

    def load(pair: Pair) -> "torch.nn.Module":
        """``pair``'s model: the one kept from its measurement, else loaded
        (and kept in place of the last one)."""
        if kept.get("pair") == pair:
            return kept["model"]  # type: ignore[return-value]
        kept.clear()
        gc.collect()
        model = load_model(hf_dir, parse_dtype(pair[0]), pair[1], device, model_name, gguf_path)
        kept["pair"], kept["model"] = pair, model
        return model

    def measure_pair(pair: Pair) -> Measured:
        model = load(pair)

        def tune_kernel(forward: Callable[[int], None], reset: Callable[[], None]) -> None:
            from target_service import kquant

            tunings[pair] = kquant.tune_prefetch(forward, reset)

        curve = measure_forward_curve(model, device, CALIBRATION_KS, CALIBRATION_KV, budget_s,
                                      tune_kernel if pair[1] in KQUANT_BACKENDS else None)
        log(logger, logging.INFO, "calibrated target", dtype=pair[0], backend=pair[1],
            **{f"k{k}_ms": round(v, 1) for k, v in curve.items()},
            **({"prefetch": tunings[pair]["prefetch"]} if pair in tunings else {}))
        return curve, None

    def measure_fidelity(pair: Pair) -> dict[str, object]:
        from target_service import fidelity

        t = time.perf_counter()
        if not reference and pair[1] not in QUANT_BACKENDS and pair != ("float32", "eager"):
            kept.clear()  # reloads cheaply; not alongside the float32 reference
            ensure_reference(None)
        model = load(pair)
        ensure_reference(model if pair == ("float32", "eager") else None)
        fid = fidelity.compare(fidelity.model_forward(model), reference["ids"], reference["logprobs"],  # type: ignore[arg-type]
                               CALIBRATION_FIDELITY_WINDOW, str(reference["digest"])).to_dict()
        log(logger, logging.INFO, "fidelity scored", dtype=pair[0], backend=pair[1], mean_kl=fid["mean_kl"],
            top1=fid["top1_agreement"], seconds=round(time.perf_counter() - t, 1))
        return fid

    tunings: dict[Pair, dict[str, object]] = {}
    result = choose(pairs, measure_pair, cache, fidelity_needed, tunings,
                    measure_fidelity if fidelity_needed else None)
    result.chosen_by = how
    apply_tuning(result.backend, result.tuning.get(pair_key((result.dtype, result.backend)), {}))
    model = kept.get("model") if kept.get("pair") == (result.dtype, result.backend) else None
    kept.clear()
    log(logger, logging.INFO, "target numerics chosen", dtype=result.dtype, backend=result.backend,
        chosen_by=how, cached=result.cached, calibration_s=result.seconds, draft_ms=result.draft_ms,
        tuning=result.tuning.get(pair_key((result.dtype, result.backend)), {}),
        scores=result.scores, table="\n" + result.table())
    return result, model  # type: ignore[return-value]
