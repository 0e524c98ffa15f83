"""CurveZMQ, the option: with the coordinator's key pair configured, the link is encrypted (a
sniffer on the network reads no host, reason or path) and ranks and operators only talk to the
coordinator holding the secret key; the tokens still decide who may say what."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from nanguard import curve
from nanguard.client import Client
from nanguard.coordinator.control import request
from nanguard.errors import CoordinatorUnreachable

from conftest import until
from test_coordinator_chaos import Proxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN, OPERATOR_TOKEN = "curve-ranks", "curve-operators"
IDENTITY = {"rank": 0, "local_rank": 0, "world_size": 2, "host": "secret-host-name", "pid": 7, "job": "curve-job",
            "device": "cpu", "version": "t"}


def registered(address: str, public: str | None) -> list[int]:
    try:
        body = request(address, TOKEN, "status_request", {}, curve_public_key=public, timeout_s=2).body
    except CoordinatorUnreachable:
        return []
    return [r["rank"] for r in body["ranks"]]


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "curve"])
def test_what_a_sniffer_reads(coordinator, encrypted):
    public, secret = curve.keypair()
    coordinator.start(env={"NANGUARD_TOKEN": TOKEN, "NANGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN,
                           **({"NANGUARD_CURVE_SECRET_KEY": secret} if encrypted else {})})
    key = public if encrypted else None
    proxy = Proxy(coordinator.port)
    stops = []
    client = Client(f"tcp://127.0.0.1:{proxy.port}", token=TOKEN, identity=IDENTITY, heartbeat_s=0.2,
                    curve_public_key=key, on_stop=lambda *a: stops.append(a))
    client.start()
    try:
        until(lambda: registered(coordinator.address, key) == [0], "rank 0 registered")
        request(coordinator.address, None, "stop_request", {"reason": "a-confidential-reason"},
                operator_token=OPERATOR_TOKEN, curve_public_key=key, timeout_s=10)
        until(lambda: stops, "the stop")
        client.close()
        seen = bytes(proxy.seen)
        for secret_text in (b"secret-host-name", b"a-confidential-reason", b"curve-job"):
            assert (secret_text in seen) is not encrypted, secret_text
    finally:
        client.close()
        proxy.close()


def test_only_clients_with_the_coordinators_public_key_get_through(coordinator):
    public, secret = curve.keypair()
    wrong, _ = curve.keypair()
    coordinator.start(env={"NANGUARD_TOKEN": TOKEN, "NANGUARD_CURVE_SECRET_KEY": secret})
    clients = [Client(coordinator.address, token=TOKEN, identity=dict(IDENTITY, rank=rank), heartbeat_s=0.2,
                      curve_public_key=key) for rank, key in ((0, public), (1, wrong), (1, None))]
    for client in clients:
        client.start()
    try:
        until(lambda: registered(coordinator.address, public) == [0], "rank 0 registered")
        time.sleep(1.0)
        assert registered(coordinator.address, public) == [0]  # the others never completed a connection
        assert registered(coordinator.address, None) == [] and registered(coordinator.address, wrong) == []
        # nothing of theirs reached nanguard: they are not counted as bad messages, they never arrive
        assert coordinator.value("nanguard_bad_messages_total") == 0
    finally:
        for client in clients:
            client.close()


def test_nanguard_keys_and_the_operator_commands(coordinator):
    out = subprocess.run([sys.executable, "-m", "nanguard", "keys"], capture_output=True, text=True, timeout=60,
                         env=coordinator.env(), check=True).stdout
    keys = dict(line.split("=", 1) for line in out.splitlines() if not line.startswith("#"))
    assert curve.public_key(keys["NANGUARD_CURVE_SECRET_KEY"]) == keys["NANGUARD_CURVE_PUBLIC_KEY"]
    coordinator.start(env={"NANGUARD_CURVE_SECRET_KEY": keys["NANGUARD_CURVE_SECRET_KEY"]})
    status = coordinator.cli("status", "--coordinator", coordinator.address, "--timeout-s", "5",
                             env={"NANGUARD_CURVE_PUBLIC_KEY": keys["NANGUARD_CURVE_PUBLIC_KEY"]})
    assert status.returncode == 0, status.stderr
    plain = coordinator.cli("status", "--coordinator", coordinator.address, "--timeout-s", "1")
    assert plain.returncode == 1 and "NANGUARD_CURVE_PUBLIC_KEY" in plain.stderr
    bad = coordinator.cli("status", "--coordinator", coordinator.address, env={"NANGUARD_CURVE_PUBLIC_KEY": "x"})
    assert bad.returncode == 2 and "40 characters of Z85" in bad.stderr


GUARDED = """
import time, torch, nanguard
from torch import nn
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
guard = nanguard.init(model, opt)
for step in range(200):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.05)
"""


def test_a_guard_with_the_public_key_reaches_a_curve_coordinator(coordinator, tmp_path):
    public, secret = curve.keypair()
    coordinator.start(env={"NANGUARD_TOKEN": TOKEN, "NANGUARD_CURVE_SECRET_KEY": secret})
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED)
    proc = subprocess.Popen([sys.executable, str(script)], start_new_session=True,
                            env=coordinator.env(NANGUARD_COORDINATOR=coordinator.address, NANGUARD_TOKEN=TOKEN,
                                                NANGUARD_CURVE_PUBLIC_KEY=public))
    try:
        until(lambda: registered(coordinator.address, public) == [0], "the guard's rank registered", timeout_s=30)
    finally:
        proc.kill()
        proc.wait()
