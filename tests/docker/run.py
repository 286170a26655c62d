"""`make test-docker`: build the CPU image and run the compose demo for real.

    1. tools    docker.io, docker-compose and debootstrap from apt when missing (as root)
    2. engine   `dockerd --bridge=none --iptables=false` when no engine answers; stopped at
                the end if it was started here (no docker0 bridge: containers use the host's
                network, on 127.0.0.1 only)
    3. base     local/bookworm:base from `debootstrap --variant=minbase` (no registry is
                reachable); made once, then kept by the engine
    4. image    ftis-node:cpu from docker/Dockerfile.cpu on that base; the layer cache makes
                a rebuild after a code change take seconds
    5. demo     docker/compose.cpu.yml + tests/docker/compose.test.yml: the bootstrap and two
                joiners; through each node's status URL: healthy, >= ROUNDS rounds done, and
                samples admitted from both other nodes
    6. SIGTERM  to the bootstrap in the middle of a round: it exits 0 and its volume holds a
                checkpoint of its last finished round (checked with the image's own loader)
    7. down -v  no container, network or volume of the project is left

Before all that, tests/test_deploy.py runs with compose installed, so every compose file
(the GPU one included) also passes `compose config`.

Figures (times, image size) go to runs/docker/report.json, logs next to it. Run as root
with the project's venv: `.venv/bin/python tests/docker/run.py` (what `make test-docker` does).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "runs" / "docker"
BASE_IMAGE = "local/bookworm:base"
IMAGE = "ftis-node:cpu"
PROJECT = "ftis-test"
NODES = ("bootstrap", "small", "large")
ROUNDS = 3
MID_ROUND = {"generating", "publishing", "gathering", "training"}
COMPOSE_FILES = [ROOT / "docker" / "compose.cpu.yml", ROOT / "tests" / "docker" / "compose.test.yml"]
report: dict = {}


def log(message: str) -> None:
    print(f"[test-docker {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(cmd: list[str], *, timeout: float = 600, check: bool = True, quiet: bool = False, **kw) -> str:
    """Run a command; its output is returned, and shown (tail) if it fails."""
    if not quiet:
        log("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout


def ok(cmd: list[str], timeout: float = 30) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ---------------------------------------------------------------------- 1-2: tools, engine
def compose_command() -> list[str]:
    if ok(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return []


def ensure_tools() -> list[str]:
    started = time.monotonic()
    missing = [tool for tool in ("docker", "dockerd", "debootstrap") if not shutil.which(tool)]
    if missing or not compose_command():
        if os.geteuid() != 0:
            wanted = ", ".join(missing or ["docker compose"])
            raise SystemExit(f"missing {wanted}; as root: apt-get install docker.io docker-compose debootstrap")
        env = os.environ | {"DEBIAN_FRONTEND": "noninteractive"}
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", "docker.io", "docker-compose", "debootstrap"], env=env)
    report["tools_s"] = round(time.monotonic() - started, 1)
    return compose_command()


@contextmanager
def engine():
    """A running container engine; one started here is stopped (by its PID) on the way out."""
    if ok(["docker", "info"], timeout=20):
        report["engine"] = "already running"
        yield
        return
    started = time.monotonic()
    logfile = open(OUT / "dockerd.log", "w")
    proc = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false"], stdout=logfile, stderr=subprocess.STDOUT)
    try:
        while not ok(["docker", "info"], timeout=10):
            if proc.poll() is not None or time.monotonic() - started > 90:
                raise SystemExit(f"dockerd did not start; see {OUT / 'dockerd.log'}")
            time.sleep(1)
        report["engine"] = f"started here in {time.monotonic() - started:.1f}s"
        log(report["engine"])
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logfile.close()
        # dockerd leaves its bind mount of the host's network namespace behind.
        netns = "/run/docker/netns/default"
        if any(line.split()[1] == netns for line in Path("/proc/mounts").read_text().splitlines()):
            subprocess.run(["umount", netns], check=False)
        log("dockerd stopped")


# ---------------------------------------------------------------------- 3-4: images
def debian_mirror() -> str:
    """The Debian mirror apt uses here (deb822 or one-line sources)."""
    for path in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")):
        for line in path.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    sources = Path("/etc/apt/sources.list")
    for line in sources.read_text().splitlines() if sources.is_file() else []:
        parts = line.split()
        if parts[:1] == ["deb"] and "security" not in line:
            return next(p for p in parts[1:] if p.startswith(("http", "file")))
    return "http://deb.debian.org/debian"


def ensure_base_image() -> None:
    if ok(["docker", "image", "inspect", BASE_IMAGE]):
        report["base_image"] = "cached"
        return
    started = time.monotonic()
    rootfs = Path(tempfile.mkdtemp(prefix="ftis-rootfs-", dir="/var/tmp"))
    try:
        run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), debian_mirror()], timeout=900)
        # Slim it the way Debian's own container images are: no docs, man pages or locales,
        # now and for what apt installs later.
        for pattern in ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "usr/share/doc/*", "usr/share/man/*"):
            for path in rootfs.glob(pattern):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        (rootfs / "etc/dpkg/dpkg.cfg.d/slim").write_text(
            "path-exclude /usr/share/doc/*\npath-exclude /usr/share/man/*\npath-exclude /usr/share/info/*\n"
        )
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run(["docker", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_IMAGE], stdin=tar.stdout)
        if tar.wait() != 0:
            raise SystemExit("tar of the debootstrap root failed")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    report["base_image"] = f"made in {time.monotonic() - started:.1f}s"


def pip_setting(key: str) -> str | None:
    """One of this machine's pip settings (env var first, then pip's config files)."""
    value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if value:
        return value
    listing = run([sys.executable, "-m", "pip", "config", "list"], check=False, quiet=True)
    for line in listing.splitlines():
        name, _, raw = line.partition("=")
        if name.split(".")[-1] == key:
            return raw.strip().strip("'\"")
    return None


def fill_local_context() -> str | None:
    """docker/local/: this machine's torch wheel and pip's CA / index, for the build stage.

    Returns the TORCH_INDEX to build with (None: the Dockerfile's default, PyTorch's index)."""
    local = ROOT / "docker" / "local"
    wheels = [
        w
        for folder in (pip_setting("find-links") or "").split()
        if Path(folder).is_dir()
        for w in sorted(Path(folder).glob("torch-2.13.0+cpu-cp311-*.whl"))
    ]
    for wheel in wheels[:1]:
        target = local / wheel.name
        if not target.is_file() or target.stat().st_size != wheel.stat().st_size:
            shutil.copyfile(wheel, target)
    conf = ["[global]"]
    cert = pip_setting("cert")
    if cert and Path(cert).is_file():
        shutil.copyfile(cert, local / "ca.pem")
        conf.append("cert = /local/ca.pem")
    index = pip_setting("index-url")
    if index and index.startswith(("http://", "https://")):
        conf.append(f"index-url = {index}")
    (local / "pip.conf").write_text("\n".join(conf) + "\n")
    report["local_context"] = {"torch_wheel": wheels[0].name if wheels else None, "pip_conf": conf[1:]}
    return (index or "https://pypi.org/simple") if wheels else None


def build_image() -> None:
    torch_index = fill_local_context()
    cmd = ["docker", "build", "--network", "host", "--force-rm", "-f", "docker/Dockerfile.cpu"]
    cmd += ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "-t", IMAGE, "."]
    if torch_index:
        cmd[-3:-3] = ["--build-arg", f"TORCH_INDEX={torch_index}"]
    started = time.monotonic()
    output = run(cmd, cwd=ROOT, env=os.environ | {"DOCKER_BUILDKIT": "0"}, timeout=1500)
    (OUT / "build.log").write_text(output)
    steps = output.count("\nStep ")
    cached = output.count("Using cache")
    size = int(run(["docker", "image", "inspect", "-f", "{{.Size}}", IMAGE], quiet=True))
    report["build"] = {"seconds": round(time.monotonic() - started, 1), "steps": steps, "steps_cached": cached}
    report["image_size_mb"] = round(size / 1e6)
    log(f"{IMAGE}: {size / 1e6:.0f} MB, built in {report['build']['seconds']}s ({cached}/{steps} steps cached)")


# ---------------------------------------------------------------------- 5-7: the demo
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/status", timeout=3) as reply:
            return json.load(reply)
    except (OSError, ValueError):
        return {}


def inspect(cid: str, fmt: str) -> str:
    return run(["docker", "inspect", "-f", fmt, cid], quiet=True).strip()


class Demo:
    def __init__(self, compose: list[str]) -> None:
        ports = {name: free_port() for name in NODES}
        self.urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        self.env = os.environ | {f"FTIS_TEST_PORT_{n.upper()}": str(p) for n, p in ports.items()}
        self.env["FTIS_BOOTSTRAP"] = f"127.0.0.1:{ports['bootstrap']}"
        self.file = OUT / "compose.yml"
        self.compose = [*compose, "-p", PROJECT, "-f", str(self.file)]
        self.last: dict[str, dict] = {}

    def write_effective_file(self, compose: list[str]) -> None:
        """The user's compose file with the test override merged in, minus the port
        mappings: host networking replaces them, and compose refuses both at once."""
        files = [arg for f in COMPOSE_FILES for arg in ("-f", str(f))]
        spec = yaml.safe_load(run([*compose, "-p", PROJECT, *files, "config"], env=self.env, quiet=True))
        for name, svc in spec["services"].items():
            assert svc.get("network_mode") == "host", f"{name} is not on the host network"
            svc.pop("ports", None)
        self.file.write_text(yaml.safe_dump(spec, sort_keys=False))

    def dc(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        return run([*self.compose, *args], env=self.env, timeout=timeout, check=check, cwd=ROOT)

    def cid(self, name: str) -> str:
        return self.dc("ps", "-q", name).strip()

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, url in self.urls.items():
                if s := status(url):
                    self.last[name] = s
            if predicate():
                return
            time.sleep(1)
        self.save_logs()
        summary = {n: {k: s.get(k) for k in ("phase", "rounds_done", "peer_id")} for n, s in self.last.items()}
        raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}; last status: {summary}; logs in {OUT}")

    def exchanged(self) -> bool:
        """Every node: ROUNDS rounds done and samples admitted from both others."""
        if len(self.last) < len(NODES):
            return False
        ids = {n: s.get("peer_id") for n, s in self.last.items()}
        for name, s in self.last.items():
            if (s.get("rounds_done") or 0) < ROUNDS:
                return False
            for other in NODES:
                peer = s.get("peers", {}).get(ids[other]) if other != name else {"samples_admitted": 1}
                if not peer or peer.get("samples_admitted", 0) <= 0:
                    return False
        return True

    def save_logs(self) -> None:
        """The containers' output to runs/docker/compose.log, while they still exist."""
        if self.dc("ps", "-q", check=False).strip():
            (OUT / "compose.log").write_text(self.dc("logs", "--no-color", "--timestamps", check=False))

    def run(self) -> None:
        timings = report.setdefault("demo", {})
        self.dc("down", "-v", "--remove-orphans", check=False)  # what a failed earlier run left
        started = time.monotonic()
        # Returns once the joiners are started, i.e. after the bootstrap turned healthy.
        self.dc("up", "-d", "--no-build", timeout=900)
        timings["up_s"] = round(time.monotonic() - started, 1)
        cids = {name: self.cid(name) for name in NODES}
        self.wait_for(
            lambda: all(inspect(c, "{{.State.Health.Status}}") == "healthy" for c in cids.values()),
            420,
            "every node to be healthy",
        )
        timings["healthy_s"] = round(time.monotonic() - started, 1)
        self.wait_for(self.exchanged, 600, f"{ROUNDS} rounds on every node with samples from both others")
        timings["rounds_s"] = round(time.monotonic() - started, 1)
        report["nodes"] = {
            n: {"rounds_done": s["rounds_done"], "peers": {p: v["samples_admitted"] for p, v in s["peers"].items()}}
            for n, s in self.last.items()
        }
        log(f"{ROUNDS}+ rounds on every node, samples from both others, {timings['rounds_s']}s after `up`")

        # A SIGTERM while the bootstrap is inside a round.
        self.wait_for(lambda: self.last["bootstrap"].get("phase") in MID_ROUND, 120, "the bootstrap to be mid-round")
        phase, done = self.last["bootstrap"]["phase"], self.last["bootstrap"]["rounds_done"]
        run(["docker", "kill", "--signal", "TERM", cids["bootstrap"]])
        stopping = time.monotonic()
        code = run(["docker", "wait", cids["bootstrap"]], timeout=120).strip()
        timings["sigterm_exit_s"] = round(time.monotonic() - stopping, 1)
        assert code == "0", f"the bootstrap exited {code} after SIGTERM in phase {phase}"
        self.dc("stop")
        for name, cid in cids.items():
            assert inspect(cid, "{{.State.ExitCode}}") == "0", f"{name} exited {inspect(cid, '{{.State.ExitCode}}')}"
            assert inspect(cid, "{{.RestartCount}}") == "0", f"{name} was restarted (it crashed at least once)"
        self.save_logs()
        checked = self.check_volumes()
        boot = checked["bootstrap"]
        assert boot["checkpoint_round"] == boot["last_round"] and boot["rounds_done"] >= done, boot
        report["sigterm"] = {"phase_at_sigterm": phase, "rounds_done_before": done, **boot}
        log(
            f"SIGTERM in phase {phase!r}: exit 0 in {timings['sigterm_exit_s']}s, checkpoint of round "
            f"{boot['checkpoint_round']} (its last finished round) in the volume"
        )

        self.dc("down", "-v")
        label = f"label=com.docker.compose.project={PROJECT}"
        for kind in (["ps", "-a"], ["volume", "ls"], ["network", "ls"]):
            left = run(["docker", *kind, "-q", "--filter", label], quiet=True).split()
            assert not left, f"`down -v` left {kind[0]} behind: {left}"
        timings["total_s"] = round(time.monotonic() - started, 1)

    def check_volumes(self) -> dict:
        """Each node's volume: the newest checkpoint that verifies, and the status it left."""
        script = (
            "import json, pathlib\n"
            "from node.train.checkpoint import load_latest\n"
            "out = {}\n"
            f"for name in {list(NODES)!r}:\n"
            "    d = pathlib.Path('/v') / name\n"
            "    s = json.loads((d / 'status.json').read_text())\n"
            "    c = load_latest(d / 'checkpoints')\n"
            "    out[name] = {'phase': s['phase'], 'rounds_done': s['rounds_done'],\n"
            "        'last_round': s['history'][-1]['round'] if s['history'] else None,\n"
            "        'checkpoint_round': c.round if c else None}\n"
            "print(json.dumps(out))\n"
        )
        mounts = [arg for n in NODES for arg in ("-v", f"{PROJECT}_{n}:/v/{n}:ro")]
        cmd = ["docker", "run", "--rm", "--network", "none", *mounts, "--entrypoint", "python", IMAGE, "-c", script]
        checked = json.loads(run(cmd).strip().splitlines()[-1])
        for name, c in checked.items():
            assert c["phase"] == "stopped", f"{name} did not stop cleanly: {c}"
            assert c["checkpoint_round"] is not None, f"no checkpoint in {name}'s volume"
        return checked


def static_checks() -> None:
    """tests/test_deploy.py with a compose installed: every compose file (the GPU one too,
    which is never run here) must pass `compose config`, not be skipped."""
    started = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_deploy.py"]
    run(cmd, cwd=ROOT, env=os.environ | {"FTIS_REQUIRE_COMPOSE": "1", "PYTHONPATH": str(ROOT)}, timeout=600)
    report["static_checks_s"] = round(time.monotonic() - started, 1)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    compose = ensure_tools()
    static_checks()
    with engine():
        ensure_base_image()
        build_image()
        demo = Demo(compose)
        demo.write_effective_file(compose)
        try:
            demo.run()
        finally:
            demo.save_logs()
            demo.dc("down", "-v", "--remove-orphans", check=False)
    report["total_s"] = round(time.monotonic() - started, 1)
    (OUT / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"passed in {report['total_s']}s; figures in {OUT / 'report.json'}")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
