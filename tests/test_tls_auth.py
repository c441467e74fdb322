"""Transport security and client authentication end to end: the three
services on loopback with TLS everywhere, mutual TLS between the
orchestrator and draft/target (certificates from scripts/gen_dev_certs.sh),
bearer tokens on the public API. Plus the tokens-file parser and the CLI
flags that build the typed settings."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specdec.auth import TokenEntry, TokenStore, parse_tokens
from specdec.tls import TlsClientConfig, TlsServerConfig, sync_channel
from specdec.v1 import common_pb2, draft_pb2_grpc, orchestrator_pb2_grpc, target_pb2_grpc
from tests.stack import REPO, Stack, make_request, start_stack

ALICE = "alice-0123456789abcdef0123456789"
BOB = "bob-fedcba9876543210fedcba98765"
MONITOR = "monitor-00112233445566778899aabb"
TOKENS = f"# test clients\nalice:{ALICE}\nbob:{BOB}\nmonitor:{MONITOR}:Health\n"


def gen_certs(out: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot generate test certificates (scripts/gen_dev_certs.sh)")
    subprocess.run(["bash", str(REPO / "scripts" / "gen_dev_certs.sh"), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gen_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA: its certificates are not trusted by the stack, and it does not trust the stack's."""
    return gen_certs(tmp_path_factory.mktemp("other-certs"))


@pytest.fixture(scope="module")
def tokens_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("auth") / "tokens"
    f.write_text(TOKENS)
    return f


@pytest.fixture(scope="module")
def stack(tiny_models, onnx_cache_dir: Path, certs: Path, tokens_file: Path) -> Stack:  # type: ignore[no-untyped-def]
    s = start_stack(tiny_models.target, tiny_models.draft, onnx_cache_dir, tls_dir=certs,
                    orchestrator_overrides={"auth_tokens_file": tokens_file, "max_streams_per_client": 2})
    yield s
    s.close()


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def generate(stack: Stack, metadata: Any, stub: Any = None, **fields: Any) -> list[int]:
    call = (stub or stack.orch_stub()).Generate(make_request(**fields), timeout=60, metadata=metadata)
    return [t for chunk in call for t in chunk.token_ids]


def code_of(fn: Any) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def info_code(address: str, tls: TlsClientConfig | None, service: str) -> grpc.StatusCode:
    with sync_channel(address, tls) as ch:
        stub = (target_pb2_grpc.TargetStub if service == "target" else draft_pb2_grpc.DraftStub)(ch)
        return code_of(lambda: stub.GetModelInfo(common_pb2.ModelInfoRequest(), timeout=10))


# ------------------------------------------------------------ end to end
def test_greedy_generation_over_tls_and_mtls_equals_off(stack: Stack) -> None:
    off = generate(stack, bearer(ALICE), prompt="secure hello", mode="off", max_new_tokens=24)
    chunks = list(stack.orch_stub().Generate(make_request(prompt="secure hello", mode="fixed", gamma=4,
                                                          max_new_tokens=24), timeout=60, metadata=bearer(ALICE)))
    assert [t for c in chunks for t in c.token_ids] == off and len(off) == 24
    assert chunks[-1].stats.draft_tokens > 0  # the draft answered over mutual TLS
    stack.assert_clean()


def identity(certs: Path, name: str) -> TlsClientConfig:
    """Mutual TLS presenting the dev certificate ``name`` (orchestrator, draft, target, gateway, client)."""
    return TlsClientConfig(certs / "ca.crt", certs / f"{name}.crt", certs / f"{name}.key")


def test_model_services_require_a_client_certificate_from_the_ca(stack: Stack, certs: Path, other_certs: Path) -> None:
    for service, port in (("target", stack.target.port), ("draft", stack.draft.port)):
        address = f"127.0.0.1:{port}"
        good = identity(certs, "orchestrator")
        assert info_code(address, good, service) == grpc.StatusCode.OK
        no_cert = TlsClientConfig(certs / "ca.crt")
        assert info_code(address, no_cert, service) == grpc.StatusCode.UNAVAILABLE
        wrong_ca_cert = TlsClientConfig(certs / "ca.crt", other_certs / "orchestrator.crt", other_certs / "orchestrator.key")
        assert info_code(address, wrong_ca_cert, service) == grpc.StatusCode.UNAVAILABLE
        assert info_code(address, None, service) == grpc.StatusCode.UNAVAILABLE  # plaintext
    stack.assert_clean()


def test_only_the_orchestrators_certificate_may_call_the_model_services(stack: Stack, certs: Path) -> None:
    """Per-service identity under mutual TLS: a certificate from the
    deployment's CA is not enough; target and draft accept only the
    orchestrator's (CN/SAN specdec-orchestrator), so a compromised draft pod
    cannot drive the target. Health stays open for probes."""
    target, draft = f"127.0.0.1:{stack.target.port}", f"127.0.0.1:{stack.draft.port}"
    for address, service, others in ((target, "target", ("draft", "gateway", "client")),
                                     (draft, "draft", ("target", "gateway", "client"))):
        assert info_code(address, identity(certs, "orchestrator"), service) == grpc.StatusCode.OK
        for name in others:
            assert info_code(address, identity(certs, name), service) == grpc.StatusCode.PERMISSION_DENIED, name
        with sync_channel(address, identity(certs, "client")) as ch:
            h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert h.status == health_pb2.HealthCheckResponse.SERVING
    # a session call from the draft's identity: refused before the model sees it, nothing leaks
    with sync_channel(target, identity(certs, "draft")) as ch:
        from specdec.v1 import target_pb2

        prefill = target_pb2_grpc.TargetStub(ch).Prefill
        assert code_of(lambda: prefill(target_pb2.PrefillRequest(token_ids=[1, 2, 3]), timeout=10)) == \
            grpc.StatusCode.PERMISSION_DENIED
    assert len(generate(stack, bearer(ALICE), prompt="still served", max_new_tokens=3)) == 3
    stack.assert_clean()


def test_client_certificate_allow_list_flags(tmp_path: Path, certs: Path) -> None:
    """--tls-client-allow on a bare server: only the listed identities; '*'
    any certificate from the CA; the per-service defaults of specdec.tls."""
    import asyncio

    from specdec.grpc_util import start_server
    from specdec.service_cli import server_tls
    from specdec_app.cli import build_parser
    from specdec.tls import aio_channel

    def flags(*extra: str) -> TlsServerConfig:
        a = build_parser().parse_args(["serve", "target", "--tls-cert", str(certs / "target.crt"), "--tls-key",
                                       str(certs / "target.key"), "--tls-client-ca", str(certs / "ca.crt"), *extra])
        return server_tls(a)

    assert flags().allowed_clients(["specdec.v1.Target"]) == {"specdec-orchestrator"}
    assert flags().allowed_clients(["specdec.v1.Orchestrator"]) == frozenset()  # any certificate from the CA
    assert flags("--tls-client-allow", "*").allowed_clients(["specdec.v1.Target"]) == frozenset()
    with pytest.raises(SystemExit):  # an allow-list without mutual TLS means nothing: refused
        server_tls(build_parser().parse_args(["serve", "target", "--tls-cert", "s.crt", "--tls-key", "s.key",
                                              "--tls-client-allow", "x"]))
    tls = flags("--tls-client-allow", "specdec-gateway,specdec-client")

    def register(server: grpc.aio.Server) -> None:  # a stand-in method that answers its raw request
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "specdec.v1.Target", {"GetModelInfo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)})])

    async def main() -> dict[str, grpc.StatusCode]:
        handle = await start_server(register, ["specdec.v1.Target"], "127.0.0.1", 0, tls=tls)
        await handle.set_serving(True)
        out = {}
        try:
            for name in ("gateway", "client", "orchestrator", "draft"):
                async with aio_channel(f"127.0.0.1:{handle.port}", identity(certs, name),
                                       [("grpc.use_local_subchannel_pool", 1)]) as ch:
                    try:
                        assert await ch.unary_unary("/specdec.v1.Target/GetModelInfo")(b"hi", timeout=10) == b"hi"
                        out[name] = grpc.StatusCode.OK
                    except grpc.aio.AioRpcError as e:
                        out[name] = e.code()
        finally:
            await handle.stop(0)
        return out

    assert asyncio.run(main()) == {"gateway": grpc.StatusCode.OK, "client": grpc.StatusCode.OK,
                                   "orchestrator": grpc.StatusCode.PERMISSION_DENIED,
                                   "draft": grpc.StatusCode.PERMISSION_DENIED}


def test_client_not_trusting_the_server_ca_fails(stack: Stack, certs: Path, other_certs: Path) -> None:
    distrust = TlsClientConfig(other_certs / "ca.crt", certs / "orchestrator.crt", certs / "orchestrator.key")
    assert info_code(f"127.0.0.1:{stack.target.port}", distrust, "target") == grpc.StatusCode.UNAVAILABLE
    with sync_channel(stack.address, TlsClientConfig(other_certs / "ca.crt")) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        assert code_of(lambda: generate(stack, bearer(ALICE), stub, prompt="x")) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(stack.address) as ch:  # plaintext against TLS
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        assert code_of(lambda: generate(stack, bearer(ALICE), stub, prompt="x")) == grpc.StatusCode.UNAVAILABLE
    # the public API does not require a client certificate, only the CA
    with sync_channel(stack.address, TlsClientConfig(certs / "ca.crt")) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        assert len(generate(stack, bearer(ALICE), stub, prompt="x", max_new_tokens=3)) == 3
    stack.assert_clean()


@pytest.mark.parametrize(
    "metadata, code",
    [
        (None, grpc.StatusCode.UNAUTHENTICATED),
        (bearer("not-a-known-token-0000000000"), grpc.StatusCode.UNAUTHENTICATED),
        (bearer(ALICE[:-1]), grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", f"Basic {ALICE}")], grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", "Bearer")], grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", f"Bearer {ALICE} extra")], grpc.StatusCode.UNAUTHENTICATED),
        ([("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {BOB}")], grpc.StatusCode.UNAUTHENTICATED),
        (bearer(MONITOR), grpc.StatusCode.PERMISSION_DENIED),  # scoped to Health
        (bearer(BOB), grpc.StatusCode.OK),
        ([("authorization", f"bearer   {ALICE}")], grpc.StatusCode.OK),  # scheme is case-insensitive
    ],
    ids=["missing", "unknown", "prefix", "basic", "empty", "extra", "two", "scoped", "bob", "lowercase"],
)
def test_bearer_tokens(stack: Stack, metadata: Any, code: grpc.StatusCode) -> None:
    assert code_of(lambda: generate(stack, metadata, prompt="auth", max_new_tokens=2)) == code
    stack.assert_clean()


def test_health_and_reflection_stay_open_without_a_token(stack: Stack) -> None:
    ch = stack.channel()
    h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specdec.v1.Orchestrator"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    assert "specdec.v1.Orchestrator" in {s.name for s in resp.list_services_response.service}


def test_streams_are_limited_per_client_identity(stack: Stack) -> None:
    stub = stack.orch_stub()
    held = [stub.Generate(make_request(prompt="hold", max_new_tokens=400), timeout=60, metadata=bearer(ALICE))
            for _ in range(2)]
    try:
        for call in held:
            next(call)
        assert code_of(lambda: generate(stack, bearer(ALICE), prompt="x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert len(generate(stack, bearer(BOB), prompt="x", max_new_tokens=3)) == 3  # another client is unaffected
    finally:
        for call in held:
            call.cancel()
    stack.assert_clean()
    assert len(generate(stack, bearer(ALICE), prompt="x", max_new_tokens=3)) == 3  # slots came back


def test_tokens_rotate_without_restart(stack: Stack, tokens_file: Path) -> None:
    new = "carol-5555555555555555555555555"
    try:
        tmp = tokens_file.with_suffix(".new")
        tmp.write_text(f"carol:{new}\nmonitor:{MONITOR}:Health\n")
        os.replace(tmp, tokens_file)  # an atomic swap, as a Kubernetes Secret update does
        assert code_of(lambda: generate(stack, bearer(ALICE), prompt="x")) == grpc.StatusCode.UNAUTHENTICATED
        assert len(generate(stack, bearer(new), prompt="x", max_new_tokens=2)) == 2
        # a broken file keeps the previous tokens (logged), also on an explicit reload (SIGHUP)
        tokens_file.write_text("short\n")
        stack.orchestrator.reload()
        assert len(generate(stack, bearer(new), prompt="x", max_new_tokens=2)) == 2
    finally:
        tokens_file.write_text(TOKENS)
        stack.orchestrator.reload()
    assert len(generate(stack, bearer(ALICE), prompt="x", max_new_tokens=2)) == 2
    stack.assert_clean()


def test_cli_generate_and_health_over_tls(stack: Stack, certs: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from specdec_app.cli import main

    token = tmp_path / "token"
    token.write_text(BOB + "\n")
    tls = ["--tls-ca", str(certs / "ca.crt")]
    assert main(["generate", "cli over tls", "--address", stack.address, *tls, "--token-file", str(token),
                 "--json", "--max-new-tokens", "4", "--mode", "off"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 4
    assert main(["generate", "no token", "--address", stack.address, *tls, "--max-new-tokens", "2"]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    # the exec-probe command, with and without the client certificate mTLS needs
    mtls = [*tls, "--tls-cert", str(certs / "client.crt"), "--tls-key", str(certs / "client.key")]  # health is open
    assert main(["health", "--address", f"127.0.0.1:{stack.target.port}", *mtls]) == 0
    assert main(["health", "--address", f"127.0.0.1:{stack.target.port}", *tls, "--timeout", "2"]) == 1
    assert main(["health", "--address", stack.address, *tls, "--service", "specdec.v1.Orchestrator"]) == 0


def test_protected_health_needs_a_token_with_its_scope(tmp_path: Path) -> None:
    """--auth-protect-health: health and reflection need a token too, and a
    token scoped to other methods is PERMISSION_DENIED (a bare server, no models)."""
    import asyncio

    from specdec.auth import ServerGuard
    from specdec.grpc_util import start_server

    f = tmp_path / "tokens"
    f.write_text(f"gen:{ALICE}:Generate\nmonitor:{MONITOR}:Health,ServerReflection\n")

    async def main() -> None:
        handle = await start_server(lambda s: None, [], "127.0.0.1", 0,
                                    guard=ServerGuard(TokenStore(f), protect_health=True))
        await handle.set_serving(True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                health = health_pb2_grpc.HealthStub(ch)

                async def check(metadata: Any) -> grpc.StatusCode:
                    try:
                        await health.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10)
                    except grpc.aio.AioRpcError as e:
                        return e.code()
                    return grpc.StatusCode.OK

                assert await check(None) == grpc.StatusCode.UNAUTHENTICATED
                assert await check(bearer(ALICE)) == grpc.StatusCode.PERMISSION_DENIED
                assert await check(bearer(MONITOR)) == grpc.StatusCode.OK
                refl = reflection_pb2_grpc.ServerReflectionStub(ch)
                req = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in refl.ServerReflectionInfo(iter([req])):
                        pass
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                async for r in refl.ServerReflectionInfo(iter([req]), metadata=bearer(MONITOR)):
                    assert "grpc.health.v1.Health" in {s.name for s in r.list_services_response.service}
                # a request that does not parse: INVALID_ARGUMENT (grpc alone says UNKNOWN)
                raw = ch.unary_unary("/grpc.health.v1.Health/Check")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raw(b"\x0a\x02\xff\xfe", metadata=bearer(MONITOR), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await handle.stop(0)

    asyncio.run(main())


def test_server_certificates_rotate_without_restart(tmp_path: Path, certs: Path, other_certs: Path) -> None:
    """A server picks up replaced certificate, key and client CA files at the
    next handshake; files that do not load (a key that does not match) keep
    the previous ones."""
    import asyncio

    from specdec.grpc_util import start_server
    from specdec.tls import aio_channel

    live = tmp_path / "live"
    shutil.copytree(certs, live)
    old = TlsClientConfig(certs / "ca.crt", certs / "client.crt", certs / "client.key")
    new = TlsClientConfig(other_certs / "ca.crt", other_certs / "client.crt", other_certs / "client.key")

    def swap(src: Path, *names: str) -> None:
        for name in names:  # atomically, file by file
            shutil.copy(src / name, live / f".{name}.tmp")
            os.replace(live / f".{name}.tmp", live / name)

    async def main() -> None:
        handle = await start_server(lambda s: None, [], "127.0.0.1", 0,
                                    tls=TlsServerConfig(live / "target.crt", live / "target.key", live / "ca.crt"))
        await handle.set_serving(True)

        async def code(tls: TlsClientConfig) -> grpc.StatusCode:
            async with aio_channel(f"127.0.0.1:{handle.port}", tls, [("grpc.use_local_subchannel_pool", 1)]) as ch:
                try:
                    await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK

        try:
            assert (await code(old), await code(new)) == (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
            swap(other_certs, "target.crt", "target.key", "ca.crt")
            assert (await code(old), await code(new)) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK)
            swap(certs, "target.key")  # no longer matches target.crt: ignored
            assert await code(new) == grpc.StatusCode.OK
            swap(certs, "target.crt", "ca.crt")  # now a matching set again
            assert (await code(old), await code(new)) == (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
        finally:
            await handle.stop(0)

    asyncio.run(main())


# ------------------------------------------------------------ unit level
def test_tokens_file_parsing() -> None:
    entries = parse_tokens(TOKENS)
    assert [e.name for e in entries] == ["alice", "bob", "monitor"]
    assert entries[0].allows("/specdec.v1.Orchestrator/Generate")
    monitor = entries[2]
    assert monitor.allows("/grpc.health.v1.Health/Check") and not monitor.allows("/specdec.v1.Orchestrator/Generate")
    assert TokenEntry("x", b"", frozenset({"Generate"})).allows("/specdec.v1.Orchestrator/Generate")
    anonymous = parse_tokens("0123456789abcdef0123")[0]
    assert anonymous.name.startswith("token-") and "0123" not in anonymous.name  # never the token itself
    for bad in ("", "# only a comment\n", "short", "a:0123456789abcdef:x:y", ":0123456789abcdef0",
                f"a:{ALICE}\nb:{ALICE}", f"a:{ALICE}\na:{BOB}", f"a:{ALICE} trailing"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_token_store_reloads_on_change(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text(f"alice:{ALICE}\n")
    store = TokenStore(f)
    assert store.lookup(ALICE).name == "alice" and store.lookup(BOB) is None
    f.write_text(f"bob:{BOB}\n")
    assert store.lookup(ALICE) is None and store.lookup(BOB).name == "bob"
    f.unlink()  # a missing file keeps the last good tokens
    assert store.lookup(BOB).name == "bob"
    with pytest.raises(ValueError):
        TokenStore(tmp_path / "missing")


def test_lookup_is_safe_under_concurrent_reloads(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text(f"alice:{ALICE}\n")
    store = TokenStore(f)
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(300):
                assert store.lookup(ALICE) is not None
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for t in threads:
        t.start()
    for i in range(30):
        f.write_text(f"alice:{ALICE}\nbob{i}:{BOB}{i}\n")
        store.reload()
    for t in threads:
        t.join()
    assert not errors


def test_cli_flags_build_the_typed_settings(tmp_path: Path) -> None:
    from orchestrator.cli import config_from_args as orchestrator_config
    from specdec_app.cli import build_parser
    from target_service.cli import config_from_args as target_config

    a = build_parser().parse_args([
        "serve", "orchestrator", "--tls-cert", "s.crt", "--tls-key", "s.key", "--upstream-ca", "ca.crt",
        "--upstream-cert", "c.crt", "--upstream-key", "c.key", "--upstream-server-name", "specdec-target",
        "--auth-tokens-file", "tokens", "--auth-protect-health", "--max-streams-per-client", "3",
    ])
    cfg = orchestrator_config(a, 1)
    assert cfg.tls == TlsServerConfig(Path("s.crt"), Path("s.key"))
    assert cfg.upstream_tls == TlsClientConfig(Path("ca.crt"), Path("c.crt"), Path("c.key"), "specdec-target")
    assert (cfg.auth_tokens_file, cfg.auth_protect_health, cfg.max_streams_per_client) == (Path("tokens"), True, 3)
    a = build_parser().parse_args(["serve", "target", "--tls-cert", "s.crt", "--tls-key", "s.key",
                                   "--tls-client-ca", "ca.crt"])
    assert target_config(a, 1).tls == TlsServerConfig(Path("s.crt"), Path("s.key"), Path("ca.crt"))
    a = build_parser().parse_args(["serve", "target", "--tls-cert", "s.crt"])
    with pytest.raises(SystemExit):
        target_config(a, 1)
    plain = build_parser().parse_args(["serve", "orchestrator"])
    cfg = orchestrator_config(plain, 1)
    assert cfg.tls is None and cfg.upstream_tls is None and cfg.auth_tokens_file is None


# ------------------------------------------------------ the Python client
def test_python_client_streams_over_tls_with_a_token(stack: Stack, certs: Path) -> None:
    import asyncio

    from specdec_app.client import AsyncClient, Client

    off = generate(stack, bearer(ALICE), prompt="client hello", mode="off", max_new_tokens=16)
    tls = {"tls_ca": certs / "ca.crt"}
    with Client(stack.address, token=ALICE, **tls) as c:
        deltas = list(c.stream("client hello", max_new_tokens=16, mode="fixed", num_draft_tokens=3))
        assert [t for d in deltas for t in d.token_ids] == off
        res = c.generate("client hello", max_new_tokens=16)
        assert res.token_ids == off and res.text == "".join(d.text for d in deltas)
        assert res.finish_reason == "FINISH_REASON_LENGTH" and res.stats.generated_tokens == 16
        chat = c.generate([("user", "hi")], max_new_tokens=4, temperature=0.8, seed=3)
        assert len(chat.token_ids) == 4
    with Client(stack.address, token="not-a-token", **tls) as c, pytest.raises(grpc.RpcError) as e:
        c.generate("client hello", max_new_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def run() -> tuple[list[int], list[int]]:
        async with AsyncClient(stack.address, token=BOB, **tls) as ac:
            streamed = [t async for d in ac.stream("client hello", max_new_tokens=16) for t in d.token_ids]
            whole = await ac.generate("client hello", max_new_tokens=16, mode="off")
            return streamed, whole.token_ids

    streamed, whole = asyncio.run(run())
    assert streamed == off and whole == off
    stack.assert_clean()


def test_every_request_is_counted_by_status_code_and_logged(stack: Stack, caplog: Any) -> None:
    from prometheus_client import generate_latest

    caplog.set_level("INFO", logger="specdec.orchestrator")

    def count(code: str, finish: str) -> float:
        text = generate_latest(stack.orchestrator.servicer.metrics.registry).decode()
        for line in text.splitlines():
            if line.startswith("specdec_requests_total{") and f'code="{code}"' in line and f'finish_reason="{finish}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = {k: count(*k) for k in [("OK", "FINISH_REASON_LENGTH"), ("UNAUTHENTICATED", "NONE"),
                                       ("INVALID_ARGUMENT", "NONE"), ("CANCELLED", "NONE")]}
    generate(stack, bearer(ALICE), prompt="counted", max_new_tokens=3)
    assert code_of(lambda: generate(stack, bearer("wrong"), prompt="x")) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: generate(stack, bearer(BOB), prompt="x", max_new_tokens=10**6)) == grpc.StatusCode.INVALID_ARGUMENT
    call = stack.orch_stub().Generate(make_request(prompt="cancel me", max_new_tokens=400), timeout=60,
                                      metadata=bearer(BOB))
    next(call)
    call.cancel()
    stack.wait_no_sessions()
    for _ in range(100):  # the cancelled stream is accounted when its handler unwinds
        if count("CANCELLED", "NONE") > before[("CANCELLED", "NONE")]:
            break
        __import__("time").sleep(0.05)
    for key, was in before.items():
        assert count(*key) == was + 1, key
    lines = [r for r in caplog.records if r.name == "specdec.orchestrator.access"]
    fields = [getattr(r, "fields", None) or r.__dict__ for r in lines]
    text = "\n".join(r.getMessage() + " " + str(f) for r, f in zip(lines, fields))
    assert "alice" in text and "UNAUTHENTICATED" in text and "INVALID_ARGUMENT" in text and "CANCELLED" in text
    # the guard's refusals are logged under the orchestrator, not specdec.auth
    assert not [r for r in caplog.records if r.name == "specdec.auth" and "rejected" in r.getMessage()]


def test_specdec_up_gives_each_service_its_own_certificate(certs: Path) -> None:
    """`specdec up --tls-dir`: each child serves its own dev certificate, the
    orchestrator presents its own upstream (the identity target and draft
    accept), and every child's argv parses with the real CLI."""
    from specdec.service_cli import server_tls
    from specdec_app.cli import build_parser
    from specdec_app.up import SERVE, child_commands

    a = build_parser().parse_args(["up", "--tls-dir", str(certs)])
    cmds, _ = child_commands(a, "/tmp/cache")
    parsed = {name: build_parser().parse_args(argv[len(SERVE) - 1:]) for name, argv in cmds.items()}
    for name in ("target", "draft", "orchestrator"):
        assert parsed[name].tls_cert == certs / f"{name}.crt" and parsed[name].tls_key == certs / f"{name}.key"
    assert server_tls(parsed["target"]).allowed_clients(["specdec.v1.Target"]) == {"specdec-orchestrator"}
    assert parsed["orchestrator"].upstream_cert == certs / "orchestrator.crt"
    out = subprocess.run(["openssl", "x509", "-in", str(parsed["orchestrator"].upstream_cert), "-noout", "-subject"],
                         capture_output=True, text=True, check=True).stdout
    assert "CN = specdec-orchestrator" in out or "CN=specdec-orchestrator" in out
