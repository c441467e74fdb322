"""Bearer tokens never travel in plaintext by accident (docs/security.md,
"Tokens over plaintext"): the orchestrator refuses to start with a tokens
file and no TLS on a non-loopback host, clients refuse to send a token over
a plaintext channel off loopback, and the gateway refuses to pass one on over
a plaintext orchestrator channel off loopback (HTTP 403); each unless
``--allow-plaintext-tokens``, which logs a warning. Loopback is always
allowed. Real servers: the tiny target and the orchestrator bound on
0.0.0.0, dialled through this machine's non-loopback address."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from specdec_app.client import Client
from tests.stack import Stack, start_gateway, start_stack

TOKEN = "alice-0123456789abcdef0123456789"


def external_ip() -> str | None:
    """An address of this machine that is not loopback (None if it has none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ipaddress.ip_address(ip).is_loopback else ip


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("plain-auth") / "tokens"
    f.write_text(f"alice:{TOKEN}\n")
    return f


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path, tokens: Path) -> Stack:  # type: ignore[no-untyped-def]
    """An orchestrator on every interface, plaintext, with tokens: explicitly allowed."""
    s = start_stack(tiny_models.target, None, onnx_cache_dir,
                    orchestrator_overrides={"host": "0.0.0.0", "auth_tokens_file": tokens,
                                            "allow_plaintext_tokens": True})
    yield s
    s.close()


def test_the_orchestrator_refuses_tokens_over_plaintext_off_loopback(tiny_models, tokens: Path,
                                                                      onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    from orchestrator.cli import config_from_args
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import start
    from specdec_app.cli import build_parser

    cfg = OrchestratorConfig(target_addresses=["127.0.0.1:1"], tokenizer=str(tiny_models.target), port=0,
                             host="0.0.0.0", auth_tokens_file=tokens, cache_dir=onnx_cache_dir)
    with pytest.raises(ValueError, match="plaintext on 0.0.0.0.*--allow-plaintext-tokens"):
        asyncio.run(asyncio.wait_for(start(cfg), 60))  # refused before it waits for the (absent) target
    with pytest.raises(SystemExit, match="--allow-plaintext-tokens"):  # the CLI: one line, exit status 1
        config_from_args(build_parser().parse_args(
            ["serve", "orchestrator", "--host", "0.0.0.0", "--auth-tokens-file", str(tokens)]), 0)
    for ok in (["--host", "127.0.0.1"], ["--host", "::1"], ["--host", "0.0.0.0", "--allow-plaintext-tokens"],
               ["--host", "0.0.0.0", "--tls-cert", "s.crt", "--tls-key", "s.key"]):
        config_from_args(build_parser().parse_args(["serve", "orchestrator", "--auth-tokens-file", str(tokens), *ok]), 0)


def test_the_allowed_plaintext_server_warns(stack: Stack, caplog: pytest.LogCaptureFixture, tokens: Path,
                                            tiny_models, onnx_cache_dir: Path) -> None:  # type: ignore[no-untyped-def]
    from orchestrator.config import OrchestratorConfig
    from orchestrator.server import start

    caplog.set_level("WARNING", logger="specdec.orchestrator")
    cfg = OrchestratorConfig(target_addresses=[f"127.0.0.1:{stack.target.port}"], tokenizer=str(tiny_models.target),
                             port=0, host="0.0.0.0", auth_tokens_file=tokens, allow_plaintext_tokens=True,
                             cache_dir=onnx_cache_dir)
    orch = stack.loop.run(start(cfg))
    try:
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "plaintext on 0.0.0.0" in r.getMessage()]
        assert warned and "read and replay" in warned[0].getMessage()
    finally:
        stack.loop.run(orch.stop(0))


def test_clients_refuse_to_send_a_token_over_plaintext_off_loopback(stack: Stack, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from specdec_app.cli import main
    from specdec_app.client import AsyncClient

    ip = external_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback address")
    remote = f"{ip}:{stack.orchestrator.port}"
    with pytest.raises(ValueError, match=f"plaintext to {ip}.*--allow-plaintext-tokens"):
        Client(remote, token=TOKEN)
    with pytest.raises(ValueError, match="plaintext"):
        AsyncClient(remote, token=TOKEN)
    # loopback is fine, and so is no token at all (the server then answers UNAUTHENTICATED)
    with Client(f"127.0.0.1:{stack.orchestrator.port}", token=TOKEN) as c:
        assert len(c.generate("plain", max_new_tokens=3).token_ids) == 3
    with Client(remote) as c, pytest.raises(grpc.RpcError) as e:
        c.generate("plain", max_new_tokens=3)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # explicitly allowed: it reaches the server over the non-loopback address and authenticates
    with Client(remote, token=TOKEN, allow_plaintext_tokens=True) as c:
        assert len(c.generate("plain", max_new_tokens=3).token_ids) == 3

    async def run() -> int:
        async with AsyncClient(remote, token=TOKEN, allow_plaintext_tokens=True) as ac:
            return len((await ac.generate("plain", max_new_tokens=2)).token_ids)

    assert asyncio.run(run()) == 2
    # the CLI: refused with a clear message, exit status 2; allowed with the flag
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    gen = ["generate", "plain", "--address", remote, "--token-file", str(token), "--max-new-tokens", "2", "--json"]
    assert main(gen) == 2
    assert "--allow-plaintext-tokens" in capsys.readouterr().err
    assert main([*gen, "--allow-plaintext-tokens"]) == 0
    stack.assert_clean()


def test_the_gateway_does_not_pass_a_token_on_over_plaintext(stack: Stack) -> None:
    ip = external_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback address")
    body = {"model": "tiny", "prompt": "gw", "max_tokens": 2, "ignore_eos": True}  # the API's default temperature 1 may sample EOS
    remote = f"{ip}:{stack.orchestrator.port}"
    gws = [start_gateway(stack, orchestrator_address=remote),
           start_gateway(stack, orchestrator_address=remote, allow_plaintext_tokens=True),
           start_gateway(stack)]  # loopback to the orchestrator
    try:
        refused, allowed, local = (f"{gw.url}/v1/completions" for gw in gws)
        r = httpx.post(refused, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert r.status_code == 403, r.text
        err: dict[str, Any] = r.json()["error"]
        assert err["code"] == "plaintext_token" and "--allow-plaintext-tokens" in err["message"]
        assert httpx.post(refused, json=body, timeout=60).status_code == 401  # no token: the orchestrator says so
        for url in (allowed, local):
            r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
    finally:
        for gw in gws:
            stack.loop.run(gw.stop(0))
    stack.assert_clean()
