"""The compose files, Kubernetes manifests and systemd unit describe runnable nodes.

No container engine runs on our machines, so each node's command line is checked the
way the container would run it: through the real CLI with `--dry-run`, under the
environment the file gives it, and the references between services (swarm URLs, ports,
volumes) are checked against each other.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from typer.testing import CliRunner

from node.cli import app
from node.config import DEFAULT_API_PORT

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = sorted((ROOT / "docker").glob("compose*.yml"))


def resolved(args: list[str], env: dict[str, str], monkeypatch) -> dict:
    for key in [k for k in __import__("os").environ if k.startswith("FTIS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_services_are_valid_nodes(path, monkeypatch):
    spec = yaml.safe_load(path.read_text())
    services = spec["services"]
    assert len(services) >= 2
    declared_volumes = set(spec.get("volumes") or {})
    bootstraps = 0
    for name, svc in services.items():
        assert svc["command"][0] == "join", name
        assert (ROOT / "docker" / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        cfg = resolved(svc["command"], svc.get("environment", {}), monkeypatch)
        assert cfg["api_host"] == "0.0.0.0", f"{name}: the API must listen beyond the container"
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith(".") or source in declared_volumes, f"{name}: volume {source} undeclared"
        if not cfg["swarm"]:
            bootstraps += 1
            continue
        for url in cfg["swarm"]:
            target = urlparse(url)
            assert target.hostname in services, f"{name} joins {url}, not a service of {path.name}"
            assert target.port == DEFAULT_API_PORT
            assert target.hostname in svc.get("depends_on", []), f"{name} should start after {target.hostname}"
    assert bootstraps == 1


def test_kubernetes_nodes_join_the_bootstrap_service(monkeypatch):
    docs = [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    by_kind: dict[str, list[dict]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    service_names = {s["metadata"]["name"] for s in by_kind["Service"]}
    config_env = {k: v for cm in by_kind["ConfigMap"] for k, v in cm["data"].items()}
    workloads = by_kind["StatefulSet"] + by_kind["Deployment"]
    assert {w["kind"] for w in workloads} == {"StatefulSet", "Deployment"}
    for workload in workloads:
        container = workload["spec"]["template"]["spec"]["containers"][0]
        cfg = resolved(container["args"], config_env, monkeypatch)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["containerPort"] for p in container["ports"]}
        assert {cfg["port"], cfg["api_port"]} <= ports
        assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
        for url in cfg["swarm"]:
            assert urlparse(url).hostname in service_names


def test_systemd_unit_runs_join_with_a_config_file():
    # systemd allows repeated keys (Environment=), so read [Service] as a list of pairs.
    section, service = None, []
    for line in (ROOT / "deploy" / "systemd" / "ftis-node.service").read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            service.append(tuple(line.split("=", 1)))
    values = dict(service)
    env = dict(v.split("=", 1) for k, v in service if k == "Environment")
    assert values["ExecStart"].split()[1:] == ["join"]
    assert values["KillSignal"] == "SIGTERM" and int(values["TimeoutStopSec"]) >= 60
    assert env["FTIS_CONFIG"] == "/etc/ftis-node/node.yaml"
    assert env["FTIS_DATA_DIR"] in values["ReadWritePaths"] and env["FTIS_CACHE"].startswith(env["FTIS_DATA_DIR"])
