"""The ``specdec`` command line.

``serve <service>`` hands over to the service's own flags and config builder
(``target_service/cli.py``, ``draft_service/cli.py``, ``orchestrator/cli.py``,
``gateway/cli.py``); ``up`` composes them into child processes; ``generate``, ``health``,
``models``, ``bench`` and ``loadbench`` are the entry points on top.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from draft_service import cli as draft_cli
from gateway import cli as gateway_cli
from orchestrator import cli as orchestrator_cli
from specdec.models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdec.service_cli import add_common_flags
from specdec_app.commands import add_client_commands
from specdec_app.up import add_up_command
from target_service import cli as target_cli


def cmd_models(a: argparse.Namespace) -> int:
    from draft_service.export import ensure_onnx
    from specdec.logging_util import setup_logging
    from specdec.models import default_cache_dir, prepare, resolve

    setup_logging(a.log_level)
    cache = Path(a.cache_dir or default_cache_dir())
    names = a.models or [DEFAULT_TARGET, DEFAULT_DRAFT]
    for m in prepare(names, cache):
        print(f"{m.name}: {m.hf_dir}")
    for name in a.export_draft or []:
        print(f"{name} onnx: {ensure_onnx(resolve(name, cache).hf_dir, cache, a.precision, 'cpu')}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from specdec_app.bench import main as bench_main

    return bench_main(a)


def cmd_fidelity(a: argparse.Namespace) -> int:
    from specdec.logging_util import setup_logging
    from specdec_app.fidelity_cmd import main as fidelity_main

    setup_logging(service="fidelity")
    return fidelity_main(a)


def cmd_loadbench(a: argparse.Namespace) -> int:
    from specdec_app.loadbench import main as loadbench_main

    return loadbench_main(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding as gRPC services.")
    sub = p.add_subparsers(dest="cmd", required=True)
    add_up_command(sub)

    serve = sub.add_parser("serve", help="run one service (for containers)")
    services = serve.add_subparsers(dest="service", required=True, metavar="{target,draft,orchestrator,gateway}")
    target_cli.add_serve_command(services)
    draft_cli.add_serve_command(services)
    orchestrator_cli.add_serve_command(services)
    gateway_cli.add_serve_command(services)

    add_client_commands(sub)

    models = sub.add_parser("models", help="prepare (assemble, verify, convert) models into the cache")
    models.add_argument("action", choices=["prepare"])
    models.add_argument("models", nargs="*", help=f"model specs (default: {DEFAULT_TARGET} {DEFAULT_DRAFT})")
    models.add_argument("--export-draft", action="append", help="also export this model to ONNX (repeatable)")
    models.add_argument("--precision", default="int4", choices=draft_cli.PRECISIONS)
    add_common_flags(models)
    models.set_defaults(func=cmd_models)

    from specdec_app.bench import add_arguments
    from specdec_app.loadbench import add_arguments as add_load_arguments

    bench = sub.add_parser("bench", help="target-only vs speculative through the running services")
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    load = sub.add_parser("loadbench",
                          help="throughput and latency under 1..32 concurrent streams (batching, speculation on/off)")
    add_load_arguments(load)
    load.set_defaults(func=cmd_loadbench)
    from specdec_app.fidelity_cmd import add_arguments as add_fidelity_arguments

    fid = sub.add_parser("fidelity", help="every target numerics against the model file's exact dequantization")
    add_fidelity_arguments(fid)
    fid.set_defaults(func=cmd_fidelity)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
