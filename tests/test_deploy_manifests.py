"""The Kubernetes overlays, rendered with ``kubectl kustomize``, checked
against the code they deploy: every container's arguments parse with the
real ``specdec`` CLI, probes hit the health port the service opens, the
orchestrator discovers the headless Services that exist, the HPAs scale on
metrics the adapter rules derive from series the services export, and the
termination grace covers the drain. Schema validation is scripts/check_k8s.sh."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from specdec_app.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
OVERLAYS = ["dev-cpu", "prod-gpu", "dev-insecure"]
#: the secure forms: the base itself (the documented default) and the overlays built on it
SECURE = ["../base", "dev-cpu", "prod-gpu"]

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def render(path: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(REPO / "k8s" / path)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container_args(docs: list[dict[str, Any]], dep: dict[str, Any]) -> list[str]:
    """The container's args with $(VAR) expanded from its envFrom ConfigMap, as the kubelet does."""
    c = dep["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    cms = by_kind(docs, "ConfigMap")
    for src in c.get("envFrom", []):
        env.update(cms[src["configMapRef"]["name"]]["data"])
    for e in c.get("env", []):
        env[e["name"]] = e["value"]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]


def parse(args: list[str]) -> Any:
    """Parses with the real CLI (argparse exits on an unknown flag)."""
    return build_parser().parse_args(args)


def flag(args: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith(name + "="))


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(f"overlays/{request.param}")


def test_container_args_parse_with_the_cli_and_match_ports_and_probes(overlay: Any) -> None:
    name, docs = overlay
    deps = by_kind(docs, "Deployment")
    assert set(deps) == {"specdec-gateway", "specdec-orchestrator", "specdec-draft", "specdec-target"}
    for dep_name, dep in deps.items():
        service = dep_name.removeprefix("specdec-")
        args = container_args(docs, dep)
        a = parse(args)
        assert (a.cmd, a.service) == ("serve", service)
        assert a.host == "0.0.0.0" and a.metrics_host == "0.0.0.0"
        c = dep["spec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == a.metrics_port
        if service == "gateway":  # HTTP: /health (liveness, start-up) and /ready (readiness) on its port
            assert ports["http"] == a.port
            for probe, path in (("startupProbe", "/health"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
                assert c[probe]["httpGet"]["path"] == path and c[probe]["httpGet"]["port"] == "http", probe
        else:
            assert ports["grpc"] == a.port and ports["health"] == a.health_port
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[probe]["grpc"]["port"] == a.health_port, (dep_name, probe)
        # graceful termination: preStop sleep, then the drain, then the stop grace (10 s) fit in the grace period
        pod = dep["spec"]["template"]["spec"]
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] >= sleep + a.drain_timeout + 10, dep_name
        # liveness must not kill a draining pod (health is NOT_SERVING while it drains)
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] > a.drain_timeout + 10, dep_name
        assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]


def test_orchestrator_discovers_the_headless_services(overlay: Any) -> None:
    from orchestrator.cli import config_from_args as orchestrator_config

    _, docs = overlay
    services = by_kind(docs, "Service")
    a = parse(container_args(docs, by_kind(docs, "Deployment")["specdec-orchestrator"]))
    cfg = orchestrator_config(a, a.port)
    for component, addresses in (("target", cfg.target_addresses), ("draft", cfg.draft_addresses)):
        (entry,) = addresses
        host, port = entry.removeprefix("dns:///").rsplit(":", 1)
        svc = services[host]
        assert svc["spec"]["clusterIP"] == "None"  # headless: one A record per ready pod
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == component
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
        dep = by_kind(docs, "Deployment")[f"specdec-{component}"]
        assert int(port) == parse(container_args(docs, dep)).port
    public = services["specdec-orchestrator"]["spec"]
    assert public.get("type", "ClusterIP") == "ClusterIP" and public["ports"][0]["port"] == a.port
    # the gateway calls the orchestrator's Service on its port
    g = parse(container_args(docs, by_kind(docs, "Deployment")["specdec-gateway"]))
    host, port = g.orchestrator_address.rsplit(":", 1)
    assert host == "specdec-orchestrator" and int(port) == a.port
    assert services["specdec-gateway"]["spec"]["ports"][0]["port"] == g.port


def _metric_names() -> set[str]:
    from gateway.app import GatewayMetrics
    from specdec.metrics import ModelServiceMetrics, OrchestratorMetrics

    names = set()
    for reg in (OrchestratorMetrics.create().registry, ModelServiceMetrics.create("target").registry,
                ModelServiceMetrics.create("draft").registry, GatewayMetrics.create().registry):
        for fam in reg.collect():  # the series names each family exports (labelled ones have no samples yet)
            suffixes = {"histogram": ("_sum", "_count", "_bucket"), "counter": ("_total",)}.get(fam.type, ("",))
            names.update(fam.name + sfx for sfx in suffixes)
    return names


def test_hpas_scale_on_metrics_the_adapter_derives_from_exported_series() -> None:
    docs = render("overlays/prod-gpu")
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    deps = by_kind(docs, "Deployment")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == set(deps)  # one per component
    (cm,) = render("monitoring")
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    exported = _metric_names()
    provided = set()
    for rule in rules:
        series = set(re.findall(r"specdec_\w+", rule["seriesQuery"] + rule["metricsQuery"]))
        series = {s for s in series if "_queue_seconds_" in s or not s.endswith(("_count", "_sum"))}
        assert series <= exported, series - exported  # every series the rule reads is exported
        matches = re.compile(rule["name"]["matches"])
        for s in series:
            if matches.match(s):
                provided.add(matches.sub(rule["name"]["as"].replace("${1}", r"\1"), s))
    for h in hpas.values():
        assert h["spec"]["minReplicas"] >= 2
        for m in h["spec"]["metrics"]:
            assert m["type"] == "Pods"
            assert m["pods"]["metric"]["name"] in provided, m["pods"]["metric"]["name"]
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] for p in pdbs.values()} == {
        "gateway", "orchestrator", "draft", "target"}


@pytest.mark.parametrize("form", SECURE)
def test_only_the_orchestrator_reaches_draft_and_target(form: str) -> None:
    docs = render(f"overlays/{form}")
    pols = by_kind(docs, "NetworkPolicy")
    for component, port in (("target", 50053), ("draft", 50052)):
        pol = pols[f"specdec-{component}"]["spec"]
        assert pol["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        rules = [r for r in pol["ingress"] if port in [p["port"] for p in r["ports"]]]
        assert len(rules) == 1
        (peer,) = rules[0]["from"]
        assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "orchestrator"
        assert "namespaceSelector" not in peer
        scrape = [r for r in pol["ingress"] if r is not rules[0]]
        assert all(p["port"] == 9464 for r in scrape for p in r["ports"])
    gw = pols["specdec-gateway"]["spec"]
    assert gw["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert sorted(p["port"] for r in gw["ingress"] for p in r["ports"]) == [8000, 9464]
    assert [r for r in gw["ingress"] if r["ports"][0]["port"] == 9464][0]["from"][0]["namespaceSelector"]
    # the public APIs are not open to everyone: the orchestrator to the gateway and labelled clients,
    # the gateway to the ingress namespace and labelled clients (a rule without "from" admits anyone)
    orch = pols["specdec-orchestrator"]["spec"]
    for pol, port in ((orch, 50051), (gw, 8000)):
        (rule,) = [r for r in pol["ingress"] if port in [p["port"] for p in r["ports"]]]
        assert rule.get("from"), port
        labels = [(kind, sel["matchLabels"]) for peer in rule["from"] for kind, sel in peer.items()]
        # exactly the label clients are told to carry, nothing more
        assert ("podSelector", {"specdec.io/client": "true"}) in labels
        assert ("namespaceSelector", {"specdec.io/client": "true"}) in labels
    peers = [r["from"] for r in orch["ingress"] if r["ports"][0]["port"] == 50051][0]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "specdec",
                                            "app.kubernetes.io/component": "gateway"}}} in peers
    peers = [r["from"] for r in gw["ingress"] if r["ports"][0]["port"] == 8000][0]
    assert {"namespaceSelector": {"matchLabels": {"specdec.io/ingress": "true"}}} in peers


def test_prod_gpu_target_gets_a_gpu() -> None:
    docs = render("overlays/prod-gpu")
    deps = by_kind(docs, "Deployment")
    target = deps["specdec-target"]["spec"]["template"]["spec"]
    assert target["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in target["tolerations"]) and target["nodeSelector"]
    assert parse(container_args(docs, deps["specdec-target"])).target_device == "cuda"
    dev = by_kind(render("overlays/dev-cpu"), "Deployment")
    assert "nvidia.com/gpu" not in dev["specdec-target"]["spec"]["template"]["spec"]["containers"][0]["resources"].get(
        "limits", {})


@pytest.mark.parametrize("form", SECURE)
def test_tls_and_auth_are_on_in_the_base_and_its_overlays(form: str) -> None:
    from specdec.service_cli import server_tls

    docs = render(f"overlays/{form}")
    deps = by_kind(docs, "Deployment")
    for name, dep in deps.items():
        spec = dep["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets[mounts["/etc/specdec/tls"]] == f"specdec-tls-{name.removeprefix('specdec-')}"  # its identity
        args = container_args(docs, dep)
        assert flag(args, "--tls-cert") == "/etc/specdec/tls/tls.crt"
        assert flag(args, "--tls-key") == "/etc/specdec/tls/tls.key"
        if name == "specdec-gateway":  # HTTPS, and TLS to the orchestrator
            assert flag(args, "--orchestrator-ca") == "/etc/specdec/tls/ca.crt"
            c = spec["containers"][0]
            assert {c[p]["httpGet"]["scheme"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {"HTTPS"}
        elif name == "specdec-orchestrator":
            assert secrets[mounts["/etc/specdec/auth"]] == "specdec-auth"
            assert flag(args, "--auth-tokens-file") == "/etc/specdec/auth/tokens"
            assert flag(args, "--upstream-ca") == "/etc/specdec/tls/ca.crt"
        else:
            assert flag(args, "--tls-client-ca") == "/etc/specdec/tls/ca.crt"  # mutual TLS
            service = "specdec.v1." + name.removeprefix("specdec-").capitalize()
            assert server_tls(parse(args)).allowed_clients([service]) == {"specdec-orchestrator"}
        assert "--allow-plaintext-tokens" not in args
        parse(args)


def test_dev_insecure_is_the_explicit_open_form() -> None:
    """The open form is an overlay of its own, named and annotated as such:
    no TLS, no tokens, no NetworkPolicies, in its own namespace."""
    docs = render("overlays/dev-insecure")
    assert not by_kind(docs, "NetworkPolicy")
    (ns,) = by_kind(docs, "Namespace").values()
    assert ns["metadata"]["name"] == "specdec-dev-insecure"
    deps = by_kind(docs, "Deployment")
    for name, dep in deps.items():
        assert dep["metadata"]["annotations"]["specdec.io/security"] == "insecure-dev-only"
        assert dep["metadata"]["namespace"] == "specdec-dev-insecure"
        spec = dep["spec"]["template"]["spec"]
        assert not [v for v in spec.get("volumes", []) if "secret" in v], name
        a = parse(container_args(docs, dep))
        assert a.tls_cert is None and getattr(a, "auth_tokens_file", None) is None, name
    # OpenAI SDKs always send an API key: the gateway passes it on over the plaintext hop, explicitly
    assert parse(container_args(docs, deps["specdec-gateway"])).allow_plaintext_tokens
