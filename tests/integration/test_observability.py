"""A real Prometheus and a real Alertmanager (the Debian packages' binaries) watch a real coordinator
while a real 2-rank torchrun job (gloo, CPU) goes non-finite.

One job serves every check (it costs most of the time): the page reaches a webhook through
Alertmanager within a bound, every Grafana panel query of the dashboard parses and returns data,
and every rule of deploy/prometheus evaluates without error. The job makes data for every panel:
its ranks start before the coordinator (so they drop events, counted once it is up), warn on
every step (grad-norm events), then hit a NaN on rank 1 (a stop, an incident, alerts firing).

Every daemon runs in its own session and is killed with its process group in teardown, and is
also told by the kernel to die with the test process (PR_SET_PDEATHSIG), so none survives a test.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
RECORDING = REPO / "deploy" / "prometheus" / "recording.yml"
ALERTMANAGER = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "nanguard.json"
SCRAPE_JOB = "nanguard-coordinator"
NAN_STEP = 90
PAGE_WITHIN_S = 60.0
"""from the coordinator's stop to the page at the webhook (measured: a few seconds)"""
GRAFANA = {"$__rate_interval": "20s", "$__interval": "5s", "$__range": "10m", "$job": SCRAPE_JOB,
           "$rank": "0|1"}
"""what Grafana would put for its variables: the dashboard's job and both ranks selected"""
NO_DATA_PANELS = {"Transient faults by host and device"}
"""panels of a series this job never makes (nanguard_transient_events_total is born with the first
fault that a re-run of its step does not reproduce): their queries must parse, not return data"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``condition`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


def _die_with_the_test() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Daemon:
    """A Prometheus or Alertmanager in its own session, its output in a log."""

    def __init__(self, argv: list[str], log: Path):
        self.argv, self.log = argv, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent,
                                         start_new_session=True, preexec_fn=_die_with_the_test)

    def wait_ready(self, url: str) -> None:
        until(lambda: self._answers(url), 60, f"{Path(self.argv[0]).name} ready at {url} (log {self.log})")

    def _answers(self, url: str) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"{' '.join(self.argv)} exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL after 10 s; returns once the group is gone."""
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL too: whatever is left of the group
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise AssertionError(f"process group of {self.argv[0]} still alive after SIGKILL")


@pytest.fixture
def daemons():
    """Start with ``daemons(argv, log, ready_url)``; all are stopped after the test, whatever happened."""
    started: list[Daemon] = []

    def start(argv: list[str], log: Path, ready_url: str) -> Daemon:
        daemon = Daemon(argv, log)
        started.append(daemon)
        daemon.wait_ready(ready_url)
        return daemon

    yield start
    survivors = []
    for daemon in reversed(started):
        try:
            daemon.stop()
        except AssertionError as err:  # stop the others all the same
            survivors.append(str(err))
    assert survivors == []


class Webhook:
    """Alertmanager's webhook receiver: a tiny HTTP server that keeps every alert it is sent."""

    def __init__(self):
        self.alerts: list[dict] = []
        """every alert received: Alertmanager's alert, plus ``receiver`` and ``received`` (monotonic)"""
        self._lock = threading.Lock()
        webhook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.monotonic()
                with webhook._lock:
                    webhook.alerts += [dict(a, receiver=payload["receiver"], received=now)
                                       for a in payload["alerts"]]
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # bound now, served by start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, name="webhook", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def find(self, **labels: str) -> dict | None:
        with self._lock:
            return next((a for a in self.alerts if a["status"] == "firing"
                         and all(a["labels"].get(k) == v for k, v in labels.items())), None)

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
            self._thread.join(10)
        self.server.server_close()


@pytest.fixture
def webhook():
    hook = Webhook()
    try:
        yield hook
    finally:
        hook.close()


class Prometheus:
    """The HTTP API of the Prometheus under test."""

    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:  # a bad query: 400 with a JSON error body
            return json.load(err)

    def query(self, expr: str) -> dict:
        return self.get("/api/v1/query", query=expr)

    def firing(self, alertname: str) -> list[dict]:
        alerts = self.get("/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"]


def grafana(expr: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would (longest names first)."""
    for name in sorted(GRAFANA, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA[name])
    return expr


def dashboard_problems(prometheus: Prometheus, since: float) -> list[str]:
    """Every panel query, the annotation queries and the variables' label_values of the dashboard,
    with Grafana's variables replaced: what does not parse or returns no data."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]
    answers = {(p["title"], grafana(t["expr"])): {} for p in panels for t in p.get("targets", [])}
    deadline = time.monotonic() + 30  # a rate needs two scrapes of a series: they may still come
    while True:
        for title, expr in answers:
            if not answers[title, expr].get("data", {}).get("result"):
                answers[title, expr] = prometheus.query(expr)
        if all(a.get("data", {}).get("result") or (title in NO_DATA_PANELS and a.get("status") == "success")
               for (title, _), a in answers.items()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    problems = [f"panel {title!r}: {expr}: {a.get('error') or 'no data'}"
                for (title, expr), a in answers.items()
                if a["status"] != "success" or not (a["data"]["result"] or title in NO_DATA_PANELS)]
    for annotation in (a for a in dashboard["annotations"]["list"] if "expr" in a):
        # Grafana asks for a range: one marker where the expression has a value
        answer = prometheus.get("/api/v1/query_range", query=grafana(annotation["expr"]),
                                start=str(since), end=str(time.time()), step="1")
        if answer["status"] != "success" or not answer["data"]["result"]:
            problems.append(f"annotation {annotation['name']}: {answer}")
    for variable in (v for v in dashboard["templating"]["list"] if v["type"] == "query"):
        inner = grafana(variable["query"]).removeprefix("label_values(").removesuffix(")")
        selector, label = (part.strip() for part in inner.rsplit(",", 1))
        if not prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": selector})["data"]:
            problems.append(f"variable {variable['name']}: no values of {label} in {selector}")
    return problems


def rule_count(path: Path) -> int:
    return sum(len(group["rules"]) for group in yaml.safe_load(path.read_text())["groups"])


@pytest.mark.timeout(300)
def test_a_nan_pages_through_alertmanager_and_fills_every_dashboard_panel(
        tool, torchrun, coordinator, daemons, webhook, tmp_path):
    prometheus_bin = tool("prometheus")
    alertmanager_bin = tool("alertmanager" if shutil.which("alertmanager") else "prometheus-alertmanager")
    metrics_port, prometheus_port, alertmanager_port = free_port(), free_port(), free_port()

    # Alertmanager with the repository's routes and inhibitions, every receiver sent to the webhook
    config = yaml.safe_load(ALERTMANAGER.read_text())
    config["receivers"] = [{"name": r["name"], "webhook_configs": [{"url": webhook.url}]}
                           for r in config["receivers"]]
    (tmp_path / "alertmanager.yml").write_text(json.dumps(config))  # JSON is YAML
    daemons([alertmanager_bin, f"--config.file={tmp_path / 'alertmanager.yml'}",
             f"--storage.path={tmp_path / 'alertmanager-data'}",
             f"--web.listen-address=127.0.0.1:{alertmanager_port}", "--cluster.listen-address="],
            tmp_path / "alertmanager.log", f"http://127.0.0.1:{alertmanager_port}/-/ready")

    # Prometheus with the repository's rule files, scraping and evaluating every second
    (tmp_path / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS), str(RECORDING)],
        "alerting": {"alertmanagers": [
            {"static_configs": [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]}]},
        "scrape_configs": [{"job_name": SCRAPE_JOB,
                            "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
    }))
    daemons([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'prometheus-data'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            tmp_path / "prometheus.log", f"http://127.0.0.1:{prometheus_port}/-/ready")
    prometheus = Prometheus(prometheus_port)
    webhook.start()  # after the daemons: a preexec_fn fork must not happen beside a thread
    began = time.time()

    # ranks first: with no coordinator their queue of 8 fills with grad-norm warnings, and drops
    progress = tmp_path / "progress"
    job = torchrun.spawn("ddp_train.py", "--fault", "forward", "--fault-rank", "1",
                         "--fault-step", str(NAN_STEP), "--steps", str(NAN_STEP + 10),
                         "--step-sleep", "0.1", "--warn-every-step", "--progress-file", str(progress),
                         "--eval-nan-step", str(NAN_STEP - 30),  # an evaluation's NaN too: counted apart
                         env={"NANGUARD_COORDINATOR": coordinator.address, "NANGUARD_EVENT_QUEUE": "8",
                              "NANGUARD_HEARTBEAT_S": "0.2"})

    def steps_done() -> bool:
        if all(p.poll() is not None for p in job.procs):
            pytest.fail("the job ended before the coordinator started:\n" + job.wait(1).output[-4000:])
        return progress.exists() and progress.read_text() and int(progress.read_text()) >= 20

    until(steps_done, 90, "rank 0 at step 20")
    coordinator.start("--metrics-port", str(metrics_port))
    until(lambda: (coordinator.value("nanguard_stops_total", reason="nonfinite") or 0) >= 1, 90,
          "the coordinator's stop")
    stopped = time.monotonic()
    results = job.wait(120).ok(world=2)
    assert {r["error"]["event"]["step"] for r in results.values()} == {NAN_STEP}, results

    # 1. the page: NanguardNonFiniteEvent for rank 1's forward NaN, routed to the pager receiver;
    # the bound is a deadline: waiting ends, and the test fails, PAGE_WITHIN_S after the stop
    page = until(lambda: webhook.find(alertname="NanguardNonFiniteEvent"),
                 max(1.0, stopped + PAGE_WITHIN_S - time.monotonic()),
                 f"NanguardNonFiniteEvent at the webhook {PAGE_WITHIN_S:.0f} s after the stop")
    assert page["receiver"] == "nanguard-page"
    assert {k: page["labels"].get(k) for k in ("rank", "kind", "severity", "job")} == {
        "rank": "1", "kind": "forward", "severity": "critical", "job": SCRAPE_JOB}, page
    assert "rank 1" in page["annotations"]["summary"]
    print(f"page at the webhook {page['received'] - stopped:.1f} s after the coordinator's stop")

    # 2. every panel query (and the stop annotation, the variables) parses and returns data
    assert dashboard_problems(prometheus, since=began) == []

    # 3. every rule evaluates without error; the alerts this job must raise fire, the others do not
    rules = {r["name"]: r for g in prometheus.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]}
    assert len(rules) == rule_count(ALERTS) + rule_count(RECORDING)
    assert {name: r["lastError"] for name, r in rules.items() if r["health"] != "ok"} == {}
    for name in ("NanguardNonFiniteEvent", "NanguardJobStopped", "NanguardEventsDropped"):
        assert prometheus.firing(name), f"{name} does not fire"
    for name in ("NanguardRankSilent", "NanguardRankStalled", "NanguardCoordinatorDown",
                 "NanguardBadMessages"):
        assert rules[name]["state"] == "inactive", rules[name]
