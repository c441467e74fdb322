"""``specdec generate`` and ``specdec health``: gRPC clients of a running stack."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specdec.service_cli import DEFAULT_PORTS, client_tls


def add_client_commands(sub: Any) -> None:
    gen = sub.add_parser("generate", help="stream a generation from the orchestrator, then print its stats")
    gen.add_argument("prompt")
    gen.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--mode", choices=["auto", "off", "fixed", "heuristic"], default="auto", help="speculation mode")
    gen.add_argument("--min-confidence", type=float, default=0.0, help="draft confidence early stop (0 = server default)")
    gen.add_argument("--num-draft-tokens", type=int, default=0, help="γ (0 = server default)")
    gen.add_argument("--drafter", default="", help="drafter name (default: the draft service's default)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument("--tls-ca", type=Path, default=None, help="CA of the orchestrator certificate; enables TLS")
    gen.add_argument("--tls-cert", type=Path, default=None, help="client certificate (when the server wants one)")
    gen.add_argument("--tls-key", type=Path, default=None, help="key of --tls-cert")
    gen.add_argument("--token-file", type=Path, default=None, help="file holding the bearer token")
    gen.add_argument("--allow-plaintext-tokens", action="store_true",
                     help="send the token without --tls-ca to a non-loopback address (refused without it)")
    gen.set_defaults(func=cmd_generate)

    hc = sub.add_parser("health", help="check a service's gRPC health (exit 0 when SERVING)")
    hc.add_argument("--address", default=f"127.0.0.1:{DEFAULT_PORTS['orchestrator']}")
    hc.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    hc.add_argument("--timeout", type=float, default=5.0)
    hc.add_argument("--tls-ca", type=Path, default=None, help="CA of the server certificate; enables TLS")
    hc.add_argument("--tls-cert", type=Path, default=None, help="client certificate (mutual TLS)")
    hc.add_argument("--tls-key", type=Path, default=None, help="key of --tls-cert")
    hc.add_argument("--tls-server-name", default="", help="name checked against the server certificate")
    hc.set_defaults(func=cmd_health)


def build_request(a: argparse.Namespace) -> Any:
    from specdec.v1 import common_pb2
    from specdec.v1 import orchestrator_pb2 as pb
    from specdec_app.bench import speculation_config

    req = pb.GenerateRequest(
        max_new_tokens=a.max_new_tokens,
        stop=a.stop or [],
        ignore_eos=a.ignore_eos,
        speculation=speculation_config(a.mode, a.num_draft_tokens, a.drafter, a.min_confidence),
        sampling=common_pb2.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k),
    )
    if a.seed is not None:
        req.sampling.seed = a.seed
    if a.chat:
        req.messages.append(pb.ChatMessage(role="user", content=a.prompt))
    else:
        req.prompt = a.prompt
    return req


def cmd_generate(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from specdec.v1 import orchestrator_pb2_grpc

    req = build_request(a)
    text: list[str] = []
    ids: list[int] = []
    last = None
    from specdec.tls import sync_channel

    tls = client_tls(a.tls_ca, a.tls_cert, a.tls_key)
    metadata = None
    if a.token_file is not None:
        from specdec.auth import bearer_metadata

        try:
            metadata = bearer_metadata(Path(a.token_file).read_text().strip(), a.address, encrypted=tls is not None,
                                       allow_plaintext=a.allow_plaintext_tokens)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    with sync_channel(a.address, tls) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        try:
            for chunk in stub.Generate(req, timeout=a.timeout, metadata=metadata):
                text.append(chunk.text)
                ids.extend(chunk.token_ids)
                last = chunk
                if not a.json:
                    print(chunk.text, end="", flush=True)
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 2
    assert last is not None
    stats = MessageToDict(last.stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    finish = last.finish_reason
    from specdec.v1 import orchestrator_pb2 as pb

    finish_name = pb.FinishReason.Name(finish)
    if a.json:
        print(json.dumps({"text": "".join(text), "token_ids": ids, "finish_reason": finish_name, "stats": stats}))
    else:
        s = last.stats
        print("\n" + "-" * 60)
        print(f"finish_reason={finish_name} tokens={s.generated_tokens} prompt_tokens={s.prompt_tokens}")
        print(f"tokens/s={s.tokens_per_second:.2f} ttft_ms={s.time_to_first_token_ms:.0f} total_ms={s.total_ms:.0f}")
        print(f"policy={s.policy or 'off'} drafter={s.drafter or '-'} "
              f"rounds={s.rounds} drafted={s.draft_tokens} accepted={s.accepted_tokens} "
              f"acceptance={s.acceptance_rate:.3f} mean_accepted_length={s.mean_accepted_length:.2f}")
        print(f"time split: draft={s.draft_ms:.0f}ms verify={s.verify_ms:.0f}ms overhead={s.overhead_ms:.0f}ms")
    return 0


def cmd_health(a: argparse.Namespace) -> int:
    """Exit 0 when the server answers SERVING within --timeout (for exec probes
    where the kubelet's plaintext gRPC probe cannot reach a TLS port)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.tls import sync_channel

    tls = client_tls(a.tls_ca, a.tls_cert, a.tls_key, a.tls_server_name)
    with sync_channel(a.address, tls) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=a.service), timeout=a.timeout)
        except grpc.RpcError as e:
            print(f"{a.address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    print(f"{a.address}: {name}")
    return 0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1
