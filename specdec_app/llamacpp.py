"""llama.cpp's ``llama-server`` as a baseline on loopback (issue 24): started
on the same GGUF file specdec serves, sent each prompt's token ids exactly as
specdec renders them, greedy, streamed and timed here as ``specdec bench``
times its own requests. Used by scripts/bench_llamacpp.py (llama.cpp alone)
and by ``specdec bench --llamacpp-bin`` (llama.cpp target-only interleaved
with specdec's runs, prompt by prompt, so that the VM's drift falls on both
alike). Never specdec's engine: a yardstick only.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from specdec_app.bench import decode_rate, stop

TARGET_ONLY = "target-only"


def model_files(spec: str, cache_dir: Path) -> tuple[Path, Path]:
    """(the GGUF specdec serves for ``spec``, its converted HF directory: the tokenizer)."""
    from specdec.models import resolve
    from specdec.models.assembly import ensure_builtin_gguf
    from specdec.models.spec import BUILTINS, parse_spec

    parsed = parse_spec(spec)
    if parsed.kind == "builtin":
        gguf = ensure_builtin_gguf(BUILTINS[parsed.value], cache_dir)
    elif parsed.kind == "gguf":
        gguf = Path(parsed.value)
    else:
        raise SystemExit(f"llama.cpp needs a GGUF file: {spec} is not a GGUF model (a built-in name or a .gguf path; "
                         "with specdec bench, --llamacpp-model FILE)")
    return gguf, resolve(spec, cache_dir).hf_dir


def render(tok: Any, prompt: dict[str, Any]) -> tuple[str, list[int]]:
    """The prompt's text and token ids as the orchestrator renders them."""
    if prompt.get("chat"):
        text = tok.apply_chat_template([{"role": "user", "content": prompt["prompt"]}], add_generation_prompt=True,
                                       tokenize=False)
        return text, list(tok(text, add_special_tokens=False)["input_ids"])
    return prompt["prompt"], list(tok(prompt["prompt"])["input_ids"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(cmd: list[str], log: Path, timeout_s: float = 600) -> Iterator[int]:
    """Runs ``llama-server`` (``cmd`` without host/port) on a free loopback
    port; yields the port once /health answers 200; stops it after."""
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(port)], stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode}); see {log}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"llama-server not ready after {timeout_s:.0f} s; see {log}")
            time.sleep(0.5)
        yield port
    finally:
        stop(proc, 30)


def read_stream(lines: Iterable[bytes], t0: float, clock: Any = time.perf_counter) -> dict[str, Any]:
    """A streamed /completion's server-sent events: generated ids and text,
    the time of the first token (seconds after ``t0``), the last event's
    timings and stop type."""
    ids: list[int] = []
    text: list[str] = []
    first = None
    last: dict[str, Any] = {}
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[len("data: "):])
        if ev.get("tokens"):
            if first is None:
                first = clock() - t0
            ids.extend(ev["tokens"])
        text.append(ev.get("content", ""))
        last = ev
        if ev.get("stop"):
            break
    return {"token_ids": ids, "text": "".join(text), "first_token_s": first, "timings": last.get("timings", {}),
            "stop_type": last.get("stop_type")}


def complete(port: int, ids: list[int], max_new: int) -> dict[str, Any]:
    """One greedy streamed /completion of the prompt ``ids``, timed here."""
    body = json.dumps({"prompt": ids, "n_predict": max_new, "temperature": 0.0, "cache_prompt": False,
                       "stream": True, "return_tokens": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t0 = time.perf_counter()
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"llama-server /completion: HTTP {resp.status}: {resp.read()[:300]!r}")
    run = read_stream(iter(resp.readline, b""), t0)
    wall = time.perf_counter() - t0
    conn.close()
    n = len(run["token_ids"])
    ttft_ms = (run.pop("first_token_s") or wall) * 1e3
    t = run["timings"]
    drafted, accepted = int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0))
    return {**run, "tokens": n, "wall_s": wall, "ttft_ms": ttft_ms, "tok_s": n / wall if wall > 0 else 0.0,
            "decode_tok_s": decode_rate(n, wall, ttft_ms), "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


class Interleaved:
    """llama.cpp target-only as one more configuration of ``specdec bench``:
    ``llama-server`` on the GGUF file specdec serves (``--llamacpp-bin``),
    each prompt's requests taking their turn among specdec's (ABBA), so a
    slow spell of the machine falls on both alike. Start it with ``with``;
    :meth:`run` times one request (the bench keeps each prompt's fastest, as
    for its own configurations); :meth:`report` gives those runs in
    scripts/bench_llamacpp.py's llamacpp.json format."""

    def __init__(self, bin_dir: Path, gguf: Path, tokenizer_dir: Path, threads: int, out: Path) -> None:
        """``gguf``: the file llama.cpp serves (specdec's target's own);
        ``tokenizer_dir``: the target's tokenizer, which renders the prompts
        as the orchestrator does."""
        from transformers import AutoTokenizer

        self.exe = bin_dir / "llama-server"
        if not (self.exe.is_file() and os.access(self.exe, os.X_OK)):
            raise SystemExit(f"specdec bench: no executable llama-server in {bin_dir} "
                             "(bash scripts/bench_llamacpp.sh builds one)")
        self.threads = threads
        self.gguf = gguf
        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.log = out / "server-target-only.log"
        self._stack = contextlib.ExitStack()
        self.port = 0

    def __enter__(self) -> "Interleaved":
        cmd = [str(self.exe), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
               "-c", "4096", "-np", "1", "--no-webui"]
        print(f"[bench] llama.cpp target-only, interleaved: {' '.join(cmd)}", flush=True)
        self.port = self._stack.enter_context(server(cmd, self.log))
        complete(self.port, render(self.tok, {"prompt": "hello", "chat": False})[1], 4)  # warm-up
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(self, prompt: dict[str, Any], max_new: int) -> dict[str, Any]:
        """One greedy request; the result carries ``tokens_per_second`` as
        specdec's runs do."""
        _, ids = render(self.tok, prompt)
        run = complete(self.port, ids, max_new)
        return {**run, "prompt_tokens": len(ids), "tokens_per_second": run["tok_s"]}

    def report(self, best: list[tuple[dict[str, Any], dict[str, Any], list[int]]]) -> dict[str, Any]:
        """llamacpp.json's content from (prompt, its fastest run, specdec
        OFF's ids) per prompt: one target-only row each, its ids compared
        with OFF's."""
        version = subprocess.run([str(self.exe), "--version"], capture_output=True, text=True, timeout=60)
        rows = [{**run, "prompt": prompt["id"], "category": prompt["category"], "config": TARGET_ONLY,
                 "identical_to_target_only": True, "identical_to_specdec_off": run["token_ids"] == off_ids}
                for prompt, run, off_ids in best]
        build = [line for line in (version.stdout + version.stderr).splitlines() if line.startswith("version:")]
        return {"meta": {"interleaved": True, "bin": str(self.exe.parent), "target_gguf": str(self.gguf),
                         "threads": self.threads,
                         "llama_cpp_version": build[0].removeprefix("version:").strip() if build else "unknown"},
                "llama_bench": [], "rows": rows}
