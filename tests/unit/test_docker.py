"""The Dockerfiles under docker/: hadolint, their pins and defaults, and (slow) the coordinator
image's contents rebuilt as a torch-free virtual environment that runs the image's ENTRYPOINT.

No docker daemon is needed: the slow test copies what the Dockerfile COPYs, runs its
``pip install`` lines in a fresh venv (no torch), then runs the ENTRYPOINT and the HEALTHCHECK.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COORDINATOR = DOCKER / "Dockerfile.coordinator"
TRAIN = DOCKER / "Dockerfile.train"


def dockerfiles() -> list[Path]:
    return sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def one(path: Path, instruction: str) -> str:
    found = [rest for word, rest in instructions(path) if word == instruction]
    assert len(found) == 1, f"{path.name}: expected one {instruction}, found {len(found)}"
    return found[0]


def entrypoint(path: Path = COORDINATOR) -> list[str]:
    return json.loads(one(path, "ENTRYPOINT"))


def healthcheck(path: Path = COORDINATOR) -> list[str]:
    rest = one(path, "HEALTHCHECK")
    return json.loads(rest[rest.index("CMD ") + len("CMD "):])


def option(argv: list[str], name: str) -> str:
    """The value of the last ``name`` in argv (argparse: the last one wins)."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == name]
    assert values, f"{name} not in {argv}"
    return values[-1]


def pip_installs(path: Path) -> list[list[str]]:
    """The arguments of every ``pip install`` in the RUN lines, in order."""
    found = []
    for word, rest in instructions(path):
        if word == "RUN":
            for command in re.split(r"&&|;", rest):
                argv = shlex.split(command)
                if argv[:2] == ["pip", "install"]:
                    found.append(argv[2:])
    return found


def pinned(path: Path) -> dict[str, str]:
    pins = {}
    for args in pip_installs(path):
        for arg in args:
            if "==" in arg:
                name, version = arg.split("==")
                pins[name.lower()] = version
    return pins


def constraints() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def test_hadolint_passes_every_dockerfile(tool):
    hadolint = tool("hadolint")
    files = dockerfiles()
    assert {COORDINATOR, TRAIN} <= set(files)
    # failure threshold "style": anything hadolint reports fails the test
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", *map(str, files)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("path", [COORDINATOR, TRAIN], ids=lambda p: p.name)
def test_base_image_and_pins(path):
    image = one(path, "FROM").split()[0]
    name, _, tag = image.partition(":")
    assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}: pin the base image by a version tag"
    pins = pinned(path)
    assert set(pins) == {"pyzmq", "prometheus-client"}, pins
    expected = constraints()
    for package, version in pins.items():
        assert expected[package] == version, (
            f"{path.name} pins {package}=={version}, constraints.txt {expected[package]}")
    # nanguard itself without dependencies: never a torch from PyPI over the base image's (or none)
    assert ["--no-cache-dir", "--no-deps", "."] in pip_installs(path)
    user = one(path, "USER").split(":")[0]
    assert user not in ("root", "0")


def test_coordinator_image_defaults_agree():
    argv = entrypoint()
    assert argv[:2] == ["nanguard", "coordinator"]
    bind_port = option(argv, "--bind").rsplit(":", 1)[1]
    metrics_port = option(argv, "--metrics-port")
    assert option(argv, "--bind") == "tcp://0.0.0.0:5555"
    assert option(argv, "--metrics-host") == "0.0.0.0"
    assert one(COORDINATOR, "EXPOSE").split() == [bind_port, metrics_port] == ["5555", "9464"]
    volumes = json.loads(one(COORDINATOR, "VOLUME"))
    assert any(option(argv, "--log").startswith(v.rstrip("/") + "/") for v in volumes)
    check = healthcheck()
    assert check[0] == "python" and f"http://127.0.0.1:{metrics_port}/metrics" in check[-1]
    assert "CMD" not in [w for w, _ in instructions(COORDINATOR)], "docker run's arguments are appended"


@pytest.mark.parametrize("path", [COORDINATOR, TRAIN], ids=lambda p: p.name)
def test_build_context_holds_what_the_dockerfile_copies(path):
    """<Dockerfile>.dockerignore keeps .venv (torch) out of the context; each COPY source is let in."""
    ignore = Path(str(path) + ".dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    assert "*" in ignore
    for word, rest in instructions(path):
        if word == "COPY":
            sources = [s for s in shlex.split(rest) if not s.startswith("--")][:-1]
            for source in sources:
                assert (REPO / source).exists(), source
                assert source.rstrip("/") in allowed, f"{source} is copied but left out of the build context"


def test_training_image_runs_an_example_that_exists():
    cmd = json.loads(one(TRAIN, "CMD"))
    assert cmd[0] == "torchrun"
    assert (REPO / cmd[-1]).is_file()


def _image_as_venv(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The coordinator image's Python contents as a venv: its COPY lines into a folder, its pip lines."""
    venv = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    workdir = tmp_path / "root"  # the image's /
    workdir.mkdir()
    for word, rest in instructions(COORDINATOR):
        if word == "WORKDIR":
            workdir = tmp_path / "root" / rest.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif word == "COPY":
            *sources, dest = shlex.split(rest)
            for source in sources:
                target = workdir / dest / Path(source).name if dest.endswith("/") else workdir / dest
                if (REPO / source).is_dir():
                    shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(REPO / source, target)
        elif word == "RUN":
            for command in re.split(r"&&|;", rest):
                argv = shlex.split(command)
                if argv[:2] == ["pip", "install"]:
                    # the pip cache is fine here; the image does without one to stay small
                    args = [a for a in argv[2:] if a != "--no-cache-dir"]
                    result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                                             "--disable-pip-version-check", *args],
                                            cwd=workdir, capture_output=True, text=True, timeout=300)
                    assert result.returncode == 0, f"{command}:\n{result.stdout}{result.stderr}"
    shutil.rmtree(tmp_path / "root")  # as the image's `rm -rf /src`: only the installed package is left
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANGUARD_", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, env


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_coordinator_image_contents_run_the_entrypoint_without_torch(tmp_path):
    venv, env = _image_as_venv(tmp_path)
    no_torch = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
    assert "No module named 'torch'" in no_torch.stderr

    # the exact ENTRYPOINT: without a token its 0.0.0.0 bind is refused (nothing is bound)
    refused = subprocess.run(entrypoint(), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "refusing to listen on tcp://0.0.0.0:5555 without a token" in refused.stderr

    # ...with arguments appended as `docker run IMAGE ARGS` does: the last of a repeated option wins
    log = tmp_path / "coordinator.jsonl"
    argv = entrypoint() + ["--bind", "tcp://127.0.0.1:0", "--metrics-port", "0", "--log", str(log)]
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("nanguard coordinator ready bind=tcp://127.0.0.1:"), (
            ready + proc.stderr.read() if proc.poll() is not None else ready)
        port = re.search(r"metrics=http://[^ ]+:(\d+)/metrics", ready).group(1)
        check = [c.replace("127.0.0.1:9464", f"127.0.0.1:{port}") for c in healthcheck()]
        healthy = subprocess.run(check, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30)
        assert healthy.returncode == 0, healthy.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "stopped; log" in proc.stderr.read()
        assert log.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    deadline = time.monotonic() + 10
    while True:  # nothing answers any more: the health check fails
        unhealthy = subprocess.run(check, env=env, cwd=tmp_path, capture_output=True, timeout=30)
        if unhealthy.returncode != 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert unhealthy.returncode != 0
