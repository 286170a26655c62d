"""The Dockerfiles, compose files, Kubernetes manifests and systemd unit describe runnable nodes.

These are the static checks, in the default run: each node's command line goes through the
real CLI with `--dry-run` under the environment its file gives it, the references between
services (swarm URLs, ports, volumes, probes) are checked against each other, the
manifests against Kubernetes' own schemas, the compose files with the real compose when it
is installed. `make test-docker` (tests/docker/run.py) builds the CPU image and runs the
CPU compose demo for real; the GPU compose file and the manifests are only checked here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from node.config import DEFAULT_API_PORT
from node.console.cli import app
from node.serving.api import ApiServer
from node.serving.status import NodeStatus

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILES = sorted((ROOT / "docker").glob("compose*.yml"))
TEST_OVERRIDE = ROOT / "tests" / "docker" / "compose.test.yml"
K8S_VERSION = "1.30.0"
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def _substitute(m: re.Match, env: dict[str, str]) -> str:
    name, kind, word = m.groups()
    if env.get(name):
        return env[name]
    assert kind != "?", f"${{{name}}} must be set: {word}"
    return word or ""


def interpolate(value, env: dict[str, str]):
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}`, on strings inside lists and dicts."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def resolved(args: list[str], env: dict[str, str], monkeypatch) -> dict:
    for key in [k for k in os.environ if k.startswith("FTIS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    result = CliRunner().invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"([\d.]+)([smh])", duration))


# ---------------------------------------------------------------------- images
@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_take_the_base_image_as_a_build_argument(name):
    text = (ROOT / "docker" / name).read_text()
    first_from = text.index("\nFROM ")
    assert re.search(r"^ARG BASE_IMAGE=\S+", text[:first_from], re.M), "ARG BASE_IMAGE=<default> before FROM"
    assert text[first_from:].startswith("\nFROM ${BASE_IMAGE}")
    assert "COPY docker/healthcheck.py /venv/bin/ftis-node-healthcheck" in text
    assert 'ENTRYPOINT ["ftis-node"]' in text


def test_cpu_image_pins_the_cpu_torch_and_its_context_holds_what_it_copies():
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0\+cpu$", text, re.M), "the +cpu label keeps CUDA builds out"
    assert "download.pytorch.org/whl/cpu" in text
    # .dockerignore excludes everything but an allow-list: every COPY source must be on it.
    allowed = [line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")]
    sources = [s for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M) for s in line.split()[:-1]]
    assert sources
    for source in sources:
        assert any(source == a or source.startswith(a + "/") for a in allowed), f"COPY {source} is not in the context"
        assert (ROOT / source).exists(), source
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/local/torch.whl"], cwd=ROOT).returncode
    assert ignored == 0, "docker/local/ (local wheels, pip settings) must stay out of git"


def test_healthcheck_answers_for_a_running_api_and_fails_without_one():
    server = ApiServer(NodeStatus(name="n", model="tiny-s", task="toy", loss="f-tis"), port=0).start()
    script = [sys.executable, str(ROOT / "docker" / "healthcheck.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTIS_")}
    try:
        up = subprocess.run([*script, str(server.port)], capture_output=True, text=True, timeout=30, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        by_env = subprocess.run(script, timeout=30, env=env | {"FTIS_API_PORT": str(server.port)})
        assert by_env.returncode == 0
    finally:
        server.stop()
    down = subprocess.run([*script, str(server.port)], capture_output=True, text=True, timeout=30, env=env)
    assert down.returncode == 1 and "no answer from" in down.stdout


# ---------------------------------------------------------------------- compose
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_services_are_valid_nodes(path, monkeypatch):
    spec = yaml.safe_load(path.read_text())
    services = spec["services"]
    assert len(services) >= 2
    declared_volumes = set(spec.get("volumes") or {})
    bootstraps = 0
    for name, svc in services.items():
        svc = interpolate(svc, {})
        assert svc["command"][0] == "join", name
        assert (ROOT / "docker" / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        cfg = resolved(svc["command"], svc.get("environment", {}), monkeypatch)
        assert cfg["api_host"] == "0.0.0.0", f"{name}: the API must listen beyond the container"
        assert svc["healthcheck"]["test"] == ["CMD", "ftis-node-healthcheck"], name
        assert seconds(svc["healthcheck"]["start_period"]) >= 60, f"{name}: model loading needs a start period"
        assert svc["restart"] in ("on-failure", "unless-stopped", "always"), name
        assert svc["init"] is True, f"{name}: no init, so nothing reaps the DHT's helper processes"
        assert seconds(svc["stop_grace_period"]) >= 60, f"{name}: too little time for the final checkpoint"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
        for source in mounts.values():
            assert source.startswith(".") or source in declared_volumes, f"{name}: volume {source} undeclared"
        assert mounts.get(cfg["data_dir"]) in declared_volumes, f"{name}: its data dir must be a named volume"
        published = {int(p.split(":")[1]) for p in svc.get("ports", [])}
        assert cfg["api_port"] in published, f"{name}: API port {cfg['api_port']} not published"
        if not cfg["swarm"]:
            bootstraps += 1
            continue
        for url in cfg["swarm"]:
            target = urlparse(url)
            assert target.hostname in services, f"{name} joins {url}, not a service of {path.name}"
            assert target.port == DEFAULT_API_PORT
            condition = svc["depends_on"][target.hostname]["condition"]
            assert condition == "service_healthy", f"{name} should start once {target.hostname} answers"
    assert bootstraps == 1


def test_test_override_puts_every_node_on_loopback(monkeypatch):
    """What `make test-docker` runs: the CPU demo on the host network, 127.0.0.1 only."""
    base = yaml.safe_load((ROOT / "docker" / "compose.cpu.yml").read_text())["services"]
    override = yaml.safe_load(TEST_OVERRIDE.read_text())["services"]
    assert set(override) == set(base)
    ports = {name: str(18470 + i) for i, name in enumerate(base)}
    env = {f"FTIS_TEST_PORT_{n.upper()}": p for n, p in ports.items()} | {"FTIS_BOOTSTRAP": "127.0.0.1:18470"}
    for name, svc in override.items():
        assert svc["network_mode"] == "host", name
        merged_env = interpolate(base[name]["environment"] | svc["environment"], env)
        cfg = resolved(interpolate(base[name]["command"], env), merged_env, monkeypatch)
        assert cfg["host"] == cfg["api_host"] == "127.0.0.1" and cfg["port"] == 0, name
        assert cfg["api_port"] == int(ports[name])
        assert all(urlparse(u).hostname == "127.0.0.1" for u in cfg["swarm"]), cfg["swarm"]
        assert cfg["round_seconds"] <= 15 and cfg["expect_peers"] == len(base) - 1


def compose_binary() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.parametrize(
    "files",
    [[p] for p in COMPOSE_FILES] + [[ROOT / "docker" / "compose.cpu.yml", TEST_OVERRIDE]],
    ids=lambda files: "+".join(f.name for f in files),
)
def test_compose_accepts_the_files(files):
    compose = compose_binary()
    if compose is None:
        if os.environ.get("FTIS_REQUIRE_COMPOSE"):
            pytest.fail("no docker compose / docker-compose installed")
        pytest.skip("no docker compose / docker-compose installed (make test-docker installs one and runs this)")
    env = os.environ | {"FTIS_TEST_PORT_BOOTSTRAP": "1", "FTIS_TEST_PORT_SMALL": "2", "FTIS_TEST_PORT_LARGE": "3"}
    cmd = [*compose, *[a for f in files for a in ("-f", str(f))], "config", "-q"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------- Kubernetes, systemd
def k8s_docs() -> list[dict]:
    return [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]


@pytest.mark.parametrize("doc", k8s_docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_kubernetes_manifests_match_the_api_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises with the offending field


def test_kubernetes_nodes_join_the_bootstrap_service(monkeypatch):
    by_kind: dict[str, list[dict]] = {}
    for doc in k8s_docs():
        by_kind.setdefault(doc["kind"], []).append(doc)
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    config_env = {k: v for cm in by_kind["ConfigMap"] for k, v in cm["data"].items()}
    workloads = by_kind["StatefulSet"] + by_kind["Deployment"]
    assert {w["kind"] for w in workloads} == {"StatefulSet", "Deployment"}
    image_uid = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "docker" / "Dockerfile.cpu").read_text()).group(1))
    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        cfg = resolved(container["args"], config_env, monkeypatch)
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert {cfg["port"], cfg["api_port"]} <= set(ports.values())
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = container[probe]["httpGet"]
            assert check["path"] == "/healthz" and ports[check["port"]] == cfg["api_port"], probe
        assert pod["terminationGracePeriodSeconds"] >= 60
        assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == image_uid
        mounted = {m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"] for v in pod.get("volumes", [])}
        volumes |= {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        assert mounted <= volumes
        for url in cfg["swarm"]:
            target = urlparse(url)
            service = services[target.hostname]
            assert target.port in {p["port"] for p in service["spec"]["ports"]}
    pod_labels = [w["spec"]["template"]["metadata"]["labels"].items() for w in workloads]
    for name, service in services.items():
        assert any(service["spec"]["selector"].items() <= labels for labels in pod_labels), f"{name} selects no pod"


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
