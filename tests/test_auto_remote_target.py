"""AUTO where speculation pays: the tiny target behind a fault proxy that
delays every call (a remote target, whose step costs many tiny-draft
rounds). AUTO speculates there from its first rounds, varies γ, keeps the
target's greedy output, and obeys the load gate. On the local tiny stack
(tests/test_e2e_tiny.py) a draft round costs several target steps and AUTO
rightly stays plain, so those tests cannot show this."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.faults import FaultyProxy
from tests.stack import Stack, make_request
from tests.test_faults import close, faulty_stack

PROMPTS = ["hello world", "the quick brown fox", "a, b, c."]


#: what each call to the remote target waits on the way (network): a target
#: step then costs many tiny-draft rounds, as a large target
#: does, so speculation pays there and AUTO must find it
REMOTE_TARGET_DELAY_S = 0.05


@pytest.fixture(scope="module")
def remote_stack(tiny_models, onnx_cache_dir: Path) -> Stack:  # type: ignore[no-untyped-def]
    """The correlated draft with the target behind REMOTE_TARGET_DELAY_S per
    call (a fault proxy that forwards every call unchanged, late), every
    round one call (no decode-ahead: plain steps would otherwise run ahead
    on the target and hide the delay that speculative rounds pay). On the
    local tiny stack a draft round costs several target steps and AUTO
    rightly stays plain: speculation never pays there."""

    async def late(request, context):  # type: ignore[no-untyped-def]
        await asyncio.sleep(REMOTE_TARGET_DELAY_S)
        return request

    def delay_target(proxies: dict[str, FaultyProxy]) -> None:
        for method in ("Prefill", "Verify", "VerifyStream"):
            proxies["target"].on_request[method] = late

    s, proxies = faulty_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir, setup=delay_target,
                              decode_ahead=0)
    yield s
    close(s, proxies)


def test_auto_speculates_where_it_pays(remote_stack: Stack) -> None:
    """Where a target step costs far more than a draft round (the remote
    target), AUTO speculates from its first rounds, varies γ, and its greedy
    output is OFF's."""
    for prompt in PROMPTS:
        off = remote_stack.generate(prompt=prompt, mode="off", max_new_tokens=64)
        r = remote_stack.generate(prompt=prompt, mode="auto", max_new_tokens=64)
        assert r["token_ids"] == off["token_ids"], prompt
        trajectory = list(r["stats"].gamma_trajectory)
        assert r["stats"].draft_tokens > 0 and any(trajectory[:3]), trajectory
        assert len(set(trajectory)) > 1, trajectory  # the policy actually varied γ


def test_speculation_load_gate(remote_stack: Stack) -> None:
    """AUTO speculates only while at most ``speculation_max_streams``
    streams are active and the load has stayed there for ``hold_s``: with the
    gate at 1, a request that runs while another stream is open decodes
    plainly (no draft tokens) and still gives the target's greedy output; so
    does one right after, within the hold; alone, it speculates again."""
    from orchestrator.server import speculation_stream_limit

    stack = remote_stack  # where AUTO alone speculates (test_auto_speculates_where_it_pays)

    assert speculation_stream_limit(-1, "cpu") == 1 and speculation_stream_limit(-1, "cuda:0") == 0
    assert speculation_stream_limit(5, "cpu") == 5 and speculation_stream_limit(0, "cpu") == 0
    prompt = "def fib(n):"
    ref = stack.generate(prompt=prompt, mode="off", max_new_tokens=24, ignore_eos=True)["token_ids"]
    servicer = stack.orchestrator.servicer
    servicer.set_speculation_limit(1, hold_s=60.0)
    try:
        held = stack.orch_stub().Generate(make_request(prompt=prompt, mode="off", max_new_tokens=4000, ignore_eos=True),
                                          timeout=300)
        next(held)  # that stream is open and decoding
        busy = stack.generate(prompt=prompt, mode="auto", max_new_tokens=24, ignore_eos=True)
        held.cancel()
        assert busy["token_ids"] == ref
        assert busy["stats"].draft_tokens == 0 and busy["stats"].rounds > 0
        deadline = time.monotonic() + 10
        while servicer.active and time.monotonic() < deadline:
            time.sleep(0.05)
        after = stack.generate(prompt=prompt, mode="auto", max_new_tokens=24, ignore_eos=True)
        assert after["token_ids"] == ref and after["stats"].draft_tokens == 0  # within the hold
        servicer.set_speculation_limit(1, hold_s=0.0)
        # long enough for its probes' budget to cover the draft's catch-up
        alone = stack.generate(prompt=prompt, mode="auto", max_new_tokens=64, ignore_eos=True)
        assert alone["token_ids"][:24] == ref
        assert alone["stats"].draft_tokens > 0
    finally:
        servicer.set_speculation_limit(0)
