"""Shared by scripts/long_prompt_bench.py and scripts/chat_soak.py (issue 26,
long prompts and prefix reuse): the stack they launch (``specdec up`` as one
process per service, default flags unless ``--up-args`` adds some, or a tiny
random-weight stack with ``--tiny``), a fixed corpus cut to exact token
counts with the target's own tokenizer, timed Generate calls, and the
target's Prometheus metrics (KV usage, prefix-cache counters; a metric the
running target does not export reads None)."""

from __future__ import annotations

import argparse
import contextlib
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from draft_service.cli import MODEL_DRAFTER, PROMPT_LOOKUP_DRAFTER  # noqa: E402
from specdec.models import DEFAULT_TARGET  # noqa: E402
from specdec_app.bench import launched_stack  # noqa: E402
from specdec_app.loadbench import _f as fmt, child_service_pids  # noqa: E402,F401  (fmt: for the scripts)
from tests.stack import make_request, scrape_metrics  # noqa: E402

#: tests/conftest.py's tiny vocabulary: --tiny text is lower-cased and cut to it
TINY_CHARS = "abcdefghijklmnopqrstuvwxyz .,:!?\n"
#: `specdec up` flags of the tiny stack (float32 eager target, fp32 draft, one thread each)
TINY_UP_ARGS = ["--target-dtype", "float32", "--target-backend", "eager", "--target-threads", "1",
                "--draft-precision", "fp32", "--draft-threads", "1",
                "--drafters", f"{MODEL_DRAFTER},{PROMPT_LOOKUP_DRAFTER}", "--log-level", "warning",
                "--drain-timeout", "1"]
#: the target's metrics these scripts read (None when the target does not export one)
KV_USED, KV_BUDGET = "specdec_target_kv_used_tokens", "specdec_target_kv_budget_tokens"
PREFIX_QUERIES = "specdec_target_prefix_cache_queries_tokens_total"
PREFIX_HITS = "specdec_target_prefix_cache_hits_tokens_total"
ACTIVE_SESSIONS, EVICTIONS = "specdec_target_active_sessions", "specdec_target_session_evictions_total"
STATS = ("prompt_tokens", "generated_tokens", "time_to_first_token_ms", "prefill_ms", "total_ms",
         "cached_prompt_tokens", "draft_cached_prompt_tokens", "target_rebuilds", "draft_failures", "policy")

# A fixed corpus of plain prose (no digits, no symbols beyond .,:!? so that the
# tiny character vocabulary covers it once lower-cased).
CORPUS = """The river that runs past the old mill was once the only road into the valley.
Traders came down it in flat boats loaded with salt, iron and bolts of wool.
In spring the water rose so high that the lower fields became a shallow lake.
The miller kept a ledger of every flood, written in a careful and patient hand.
Children learned to swim in the quiet pool below the weir, watched by their grandparents.
A stone bridge was built when the railway arrived, and the boats slowly disappeared.
Now the mill is a small museum, and its wheel turns only on festival days.
Visitors ask why the valley floods less today, and the answer lies in the hills.
Farmers planted hedges and woods along the slopes, which hold the rain for longer.
The soil stays where it is, and the river runs clear even after a storm.
Every autumn the school takes its pupils to count the fish that return to spawn.
They write the numbers on a board by the bridge, beside the numbers of past years.
Some years are good and some are poor, but the long trend is clearly upward.
An old keeper of the lock still tells stories about the winter the river froze.
People walked across the ice to the market, carrying baskets of apples and bread.
A horse fell through near the far bank and was pulled out by six strong men.
The keeper says the ice sang at night, a long low note like a distant bell.
Nobody has heard that sound for many years, because the winters are milder now.
The library in the town keeps maps of the river drawn over several centuries.
On the oldest map the river bends twice where today it runs almost straight.
Engineers cut a new channel to speed the boats, and the old bends became ponds.
Those ponds are now full of reeds, frogs and the nests of quiet water birds.
A path follows the river from the mill to the sea, and it takes a full day to walk.
Along the way there are inns, chapels, ruined towers and a lighthouse at the end.
Walkers often stop at the lighthouse to watch the ships waiting for the tide.
The harbour master answers their questions with a patience that never seems to end.
He explains how the tide tables are made and why the channel must be dredged.
Sand moves with every storm, and a ship that strays from the channel will run aground.
Pilots come aboard far out at sea and guide each ship through the shifting banks.
It is careful work, done in every weather, by day and by night, all year round.
When the fog comes in, the horn on the point sounds every half minute until it lifts.
Old sailors say they can tell where they are from the echo of that horn alone.
The museum at the mill keeps a recording of the horn, and children love to play it.
In the evening the valley is quiet, and the only sound is the water over the weir.""".split("\n")


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    """The launch options both scripts share."""
    p.add_argument("--out", type=Path, required=True, help="output directory (JSON, markdown, PNG, logs/)")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random-weight stack as the tests use (built under OUT/models unless "
                        "--target-model/--draft-model name tiny model directories)")
    p.add_argument("--target-model", default=None, help="`specdec up --target-model` (default: its default)")
    p.add_argument("--draft-model", default=None, help="`specdec up --draft-model` (default: its default)")
    p.add_argument("--target-dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--target-backend", default="auto",
                   choices=["auto", "eager", "packed", "bf16w", "kquant", "kquant-a8", "int4", "int4-q8"])
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache (default: the services' own; with --tiny OUT/cache)")
    p.add_argument("--up-args", default="",
                   help="extra flags for `specdec up`, one string (e.g. '--target-prefix-cache "
                        "--target-kv-budget-tokens 32768')")
    p.add_argument("--mode", default="auto", choices=["auto", "off", "fixed", "heuristic"],
                   help="speculation mode of the measured requests (%(default)s)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one Generate call")


class Progress:
    """Progress lines on stderr, stamped with seconds since the start."""

    def __init__(self, name: str) -> None:
        self.name, self.t0 = name, time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def free_port_block(n: int, tries: int = 200) -> int:
    """A port p with p .. p+n-1 all free on 127.0.0.1 (`specdec up` numbers its services' ports so)."""
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(20000, 60000 - n)
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SystemExit(f"no {n} consecutive free ports")


@dataclass
class Launched:
    """A running `specdec up`: service addresses, process ids and metrics ports."""

    proc: subprocess.Popen[bytes]
    addresses: dict[str, str]
    pids: dict[str, int]
    metrics_base: int  # orchestrator; draft +1, target +2 (`specdec up --metrics-port`)
    target_model: str
    cache_dir: Path | None

    def metrics(self, service: str = "target") -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """The service's /metrics ({} when unreachable)."""
        port = self.metrics_base + {"orchestrator": 0, "draft": 1, "target": 2}[service]
        try:
            return scrape_metrics(port)
        except OSError:
            return {}


def metric(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float | None:
    """A metric's value summed over its labels; None when the service does not export it."""
    vals = [v for (n, _), v in m.items() if n == name]
    return sum(vals) if vals else None


def prefix_counters(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float | None]:
    return {"queries_tokens": metric(m, PREFIX_QUERIES), "hits_tokens": metric(m, PREFIX_HITS)}


def prefix_delta(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, Any]:
    """Prefix-cache tokens queried and hit between two scrapes, and the hit rate (None: not exported)."""
    if after["queries_tokens"] is None or after["hits_tokens"] is None:
        return {"queries_tokens": None, "hits_tokens": None, "hit_rate": None, "exported": False}
    q = after["queries_tokens"] - (before["queries_tokens"] or 0.0)
    h = after["hits_tokens"] - (before["hits_tokens"] or 0.0)
    return {"queries_tokens": q, "hits_tokens": h, "hit_rate": h / q if q > 0 else 0.0, "exported": True}


@contextlib.contextmanager
def launch(a: argparse.Namespace, say: Callable[[str], None]) -> Iterator[Launched]:
    """Starts the stack `a` asks for (models built first with --tiny) and stops it after."""
    a.out.mkdir(parents=True, exist_ok=True)
    extra: list[str] = []
    if a.tiny:
        if not (a.target_model and a.draft_model):
            from tests.tiny import build_tiny_pair

            target, draft = build_tiny_pair(a.out / "models", chars=TINY_CHARS)
            a.target_model, a.draft_model = str(target), str(draft)
        a.cache_dir = a.cache_dir or a.out / "cache"
        extra += TINY_UP_ARGS
    base, mbase = free_port_block(3), free_port_block(4)
    extra += ["--gateway-port", "0", "--metrics-port", str(mbase)]
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    say(f"starting specdec up (orchestrator :{base}, metrics :{mbase}..; output in {logs / 'up.log'})")
    with launched_stack(a, extra, base_port=base, log=logs / "up.log") as (proc, addrs):
        pids = child_service_pids(proc.pid)
        say(f"stack SERVING: {addrs}; pids {pids}")
        yield Launched(proc, addrs, pids, mbase, a.target_model or DEFAULT_TARGET, a.cache_dir)


def load_target_tokenizer(st: Launched) -> Any:
    from orchestrator.server import load_tokenizer

    return load_tokenizer(st.target_model, st.cache_dir)


class Corpus:
    """Token sequences of exact lengths from :data:`CORPUS`, in the target's
    vocabulary. Variant k starts with sentence k (mod the corpus size) and
    goes on in a shuffled order seeded by k, so two variants share no prefix
    (a prefix cache cannot serve one from the other) and a variant is the
    same on every run."""

    def __init__(self, tokenizer: Any, tiny: bool) -> None:
        self.tok = tokenizer

        self.tiny = tiny
        self.sentences = [tokenizer.encode(self.clean(s) + " ", add_special_tokens=False) for s in CORPUS]

    def clean(self, s: str) -> str:
        """``s`` as the vocabulary allows (--tiny: lower-cased, cut to :data:`TINY_CHARS`)."""
        return "".join(c for c in s.lower() if c in TINY_CHARS) if self.tiny else s

    def ids(self, n: int, variant: int = 0) -> list[int]:
        k = len(self.sentences)
        rng = random.Random(variant)
        order = [variant % k]
        out: list[int] = []
        while len(out) < n:
            if not order:
                order = rng.sample(range(k), k)
            out += self.sentences[order.pop(0)]
        return out[:n]

    def text(self, n: int, variant: int = 0) -> str:
        """About ``n`` tokens of text (exactly ``n`` ids, decoded; re-encoding may merge a boundary)."""
        return str(self.tok.decode(self.ids(n, variant), skip_special_tokens=True))


@dataclass
class Timed:
    """One Generate call as the client saw it."""

    code: str = "OK"
    details: str = ""
    ttft_ms: float | None = None  # send -> first chunk with tokens
    chunk_s: list[float] = field(default_factory=list)  # arrival of each chunk with tokens, s since send
    sent_at: float = 0.0  # time.perf_counter() at send
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"code": self.code, "details": self.details, "ttft_ms": self.ttft_ms, "tokens": len(self.token_ids),
                "finish_reason": self.finish_reason, **self.stats}


def timed_generate(stub: Any, req: Any, timeout: float, stop: Callable[[Timed], bool] | None = None) -> Timed:
    """Runs ``req``; ``stop(t)`` (checked after each chunk) cancels the call when true (code CANCELLED)."""
    import grpc

    from specdec.v1 import orchestrator_pb2 as pb

    t = Timed(sent_at=time.perf_counter())
    call = stub.Generate(req, timeout=timeout)
    try:
        for chunk in call:
            if chunk.token_ids:
                now = time.perf_counter() - t.sent_at
                t.chunk_s.append(now)
                t.ttft_ms = t.ttft_ms if t.ttft_ms is not None else now * 1e3
                t.token_ids.extend(chunk.token_ids)
                t.text += chunk.text
            if chunk.finish_reason:
                t.finish_reason = pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_")
                t.stats = {k: getattr(chunk.stats, k) for k in STATS}
            if stop is not None and stop(t):
                call.cancel()
                t.code = "CANCELLED"
                break
    except grpc.RpcError as e:
        code = e.code()
        t.code, t.details = (code.name if code is not None else "UNKNOWN"), (e.details() or "")[:300]
    return t


def request(a: argparse.Namespace, *, max_new: int, mode: str | None = None, prompt_ids: list[int] | None = None,
            messages: list[tuple[str, str]] | None = None, ignore_eos: bool = True) -> Any:
    """A greedy GenerateRequest in ``mode`` (default ``a.mode``; γ = the server's default)."""
    return make_request(prompt_token_ids=prompt_ids, messages=messages, max_new_tokens=max_new,
                        mode=mode or a.mode, gamma=0, ignore_eos=ignore_eos)


def up_label(tiny: bool, up_args: str) -> str:
    """How the report names the launched stack's flags."""
    flags = " ".join(([" ".join(TINY_UP_ARGS)] if tiny else []) + ([up_args] if up_args else []))
    return f"`{flags}`" if flags else "defaults"


def verdict_cell(v: bool | None) -> str:
    return "not measured" if v is None else ("PASS" if v else "**FAIL**")
