"""deploy/prometheus, deploy/alertmanager, deploy/grafana, docker/compose.yaml and .ci/install-tools,
checked by the real tools (promtool, amtool, shellcheck) and against each other and the
coordinator's own metric names. A real Prometheus and Alertmanager run them against a real job in
tests/integration/test_observability.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml
from prometheus_client import CollectorRegistry

from nanguard.coordinator.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
RECORDING = PROMETHEUS / "recording.yml"
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
ALERTMANAGER = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "nanguard.json"
COMPOSE = REPO / "docker" / "compose.yaml"
NAMES = re.compile(r"\bnanguard[_:][a-z0-9_:]*[a-z0-9]\b")


def run(*argv: str, **kwargs) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def load(path: Path):
    return yaml.safe_load(path.read_text())


def rules(path: Path) -> list[dict]:
    return [rule for group in load(path)["groups"] for rule in group["rules"]]


def alert_names() -> list[str]:
    return [rule["alert"] for rule in rules(ALERTS)]


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' children too."""
    return [p for top in dashboard["panels"] for p in [top, *top.get("panels", [])]]


def coordinator_series() -> set[str]:
    """The sample names the coordinator serves (counters with their _total)."""
    registry = CollectorRegistry()
    Metrics(registry, "test")
    return {f.name + "_total" if f.type == "counter" else f.name for f in registry.collect()}


# --------------------------------------------------------------------------- Prometheus
def test_promtool_checks_the_config_and_its_rule_files(tool):
    out = run(tool("promtool"), "check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert "2 rule files found" in out, out


def test_promtool_checks_the_rules(tool):
    run(tool("promtool"), "check", "rules", str(ALERTS), str(RECORDING))


def test_promtool_unit_tests_pass(tool):
    assert [p.name for p in UNIT_TESTS] == ["alerts_test.yml", "recording_test.yml"]
    run(tool("promtool"), "test", "rules", *map(str, UNIT_TESTS), cwd=PROMETHEUS / "tests")


def test_every_alert_has_a_unit_test_where_it_fires_and_one_where_it_stays_quiet():
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for case in load(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alert_names())
    assert names >= {"NanguardNonFiniteEvent", "NanguardJobStopped", "NanguardRankSilent",
                     "NanguardRankStalled", "NanguardCoordinatorDown", "NanguardEventsDropped",
                     "NanguardBadMessages", "NanguardTransientFaults"}
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested quiet"
    assert (firing | quiet) - names == set(), "tests of alerts that do not exist"


def test_every_recording_rule_has_a_unit_test():
    tested = {NAMES.search(check["expr"]).group(0)
              for path in UNIT_TESTS for case in load(path)["tests"]
              for check in case.get("promql_expr_test", [])}
    assert {rule["record"] for rule in rules(RECORDING)} == tested


def test_alerts_carry_severity_and_the_annotations_a_responder_needs():
    for rule in rules(ALERTS):
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), rule["alert"]
    pages = [rule["alert"] for rule in rules(ALERTS) if rule["labels"]["severity"] == "critical"]
    assert pages == ["NanguardNonFiniteEvent"]
    nonfinite = next(rule for rule in rules(ALERTS) if rule["alert"] == "NanguardNonFiniteEvent")
    assert nonfinite["for"] == "0m"  # a NaN pages at the first evaluation that sees it


def test_rules_and_dashboard_use_only_series_the_coordinator_serves_or_the_rules_record():
    served = coordinator_series()
    recorded = {rule["record"] for rule in rules(RECORDING)}
    dashboard = json.loads(DASHBOARD.read_text())
    texts = [rule["expr"] for rule in rules(ALERTS) + rules(RECORDING)]
    texts += [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    texts += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    texts += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for text in texts for name in NAMES.findall(text)}
    assert used - served - recorded == set()
    assert recorded <= used, "recording rules no alert or panel reads"


# --------------------------------------------------------------------------- Alertmanager
def test_amtool_checks_the_alertmanager_config(tool):
    run(tool("amtool"), "check-config", str(ALERTMANAGER))


@pytest.mark.parametrize("labels, receiver", [
    (["alertname=NanguardNonFiniteEvent", "severity=critical", "job=nanguard-coordinator"], "nanguard-page"),
    (["alertname=NanguardRankSilent", "severity=warning", "job=nanguard-coordinator"], "nanguard-team"),
    (["alertname=NanguardTransientFaults", "severity=warning", "job=nanguard-coordinator", "host=gpu-node-7",
      "device=cuda:3"], "nanguard-team"),
])
def test_alertmanager_routes_pages_and_warnings(tool, labels, receiver):
    out = run(tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels)
    assert out.split() == [receiver]


# --------------------------------------------------------------------------- Grafana
def test_dashboard_has_a_panel_for_every_signal_and_one_data_source():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    shown = [p for p in panels(dashboard) if p["type"] != "row"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in shown:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert {t["refId"] for t in panel["targets"]} == {chr(65 + i) for i in range(len(panel["targets"]))}
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip(), panel["title"]
            assert set(re.findall(r"\$(\w+)", target["expr"])) <= set(variables) | {
                "__rate_interval", "__interval", "__range"}, target["expr"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    titles = " | ".join(p["title"].lower() for p in shown)
    for needed in ("events by rank and kind", "ranks alive", "step per rank", "stragglers",
                   "gradient norm", "step time", "incidents", "dropped events", "bad messages", "stops",
                   "alerts", "transient faults by host and device"):
        assert needed in titles, needed


def test_grafana_provisioning_points_at_the_mounted_dashboard_and_prometheus():
    provider, = load(GRAFANA / "provisioning" / "dashboards" / "nanguard.yml")["providers"]
    source, = load(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    grafana = load(COMPOSE)["services"]["grafana"]
    mounts = dict(bind_mounts(grafana))
    dashboards_dir = next(src for src, target in mounts.items() if target == provider["options"]["path"])
    assert (dashboards_dir / DASHBOARD.name).is_file()
    assert mounts[GRAFANA / "provisioning"] == "/etc/grafana/provisioning"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
    assert source["type"] == "prometheus"
    assert source["url"] == f"http://prometheus:{listen_port('prometheus')}"


# --------------------------------------------------------------------------- compose
def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path resolved against docker/, container path) of every bind mount."""
    found = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            found.append(((COMPOSE.parent / source).resolve(), target))
    return found


def option(args: list[str], name: str) -> str | None:
    """The last value of ``--name value`` or ``--name=value`` (the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def listen_port(service: str) -> int:
    address = option(load(COMPOSE)["services"][service]["command"], "--web.listen-address")
    return int(address.rsplit(":", 1)[1])


def coordinator_metrics_port() -> int:
    """As the container runs it: the image's ENTRYPOINT, then compose's command appended."""
    entrypoint = next(json.loads(line.split(None, 1)[1])
                      for line in (REPO / "docker" / "Dockerfile.coordinator").read_text().splitlines()
                      if line.startswith("ENTRYPOINT"))
    return int(option(entrypoint + load(COMPOSE)["services"]["coordinator"]["command"], "--metrics-port"))


def published(service: str) -> set[int]:
    return {int(str(port).split(":")[-1]) for port in load(COMPOSE)["services"][service].get("ports", [])}


def test_compose_references_only_files_of_the_repo():
    compose = load(COMPOSE)
    assert set(compose["services"]) == {"coordinator", "prometheus", "alertmanager", "grafana"}
    build = compose["services"]["coordinator"]["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == REPO and (context / build["dockerfile"]).is_file()
    assert build["dockerfile"] == "docker/Dockerfile.coordinator"
    for name, service in compose["services"].items():
        for source, _ in bind_mounts(service):
            assert source.exists() and REPO in source.parents, f"{name}: {source}"
        named = [v.split(":")[0] for v in service.get("volumes", []) if not v.startswith((".", "/"))]
        assert set(named) <= set(compose["volumes"]), name
        image = service.get("image", "")
        pinned = re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image)
        assert name == "coordinator" or pinned, f"{name}: pin the image version, not {image!r}"


def test_compose_ports_agree_with_the_prometheus_config():
    config = load(PROMETHEUS / "prometheus.yml")
    targets = {job["job_name"]: target for job in config["scrape_configs"]
               for static in job["static_configs"] for target in static["targets"]}
    coordinator = targets["nanguard-coordinator"]
    port = coordinator_metrics_port()
    assert coordinator == f"coordinator:{port}" and port in published("coordinator")
    down = next(rule["expr"] for rule in rules(ALERTS) if rule["alert"] == "NanguardCoordinatorDown")
    assert re.fullmatch(re.search(r'up\{job=~"([^"]+)"\}', down).group(1), "nanguard-coordinator")
    alertmanager, = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    assert alertmanager == f"alertmanager:{listen_port('alertmanager')}"
    assert listen_port("alertmanager") in published("alertmanager")
    assert listen_port("prometheus") in published("prometheus")
    services = load(COMPOSE)["services"]
    # the config files the daemons are told to read are the ones mounted
    for service, flag, path in (("prometheus", "--config.file", PROMETHEUS / "prometheus.yml"),
                                ("alertmanager", "--config.file", ALERTMANAGER)):
        inside = PurePosixPath(option(services[service]["command"], flag))
        mounted = [(src, PurePosixPath(dst)) for src, dst in bind_mounts(services[service])]
        assert any(src == path and dst == inside or src == path.parent and dst == inside.parent
                   for src, dst in mounted), f"{service} reads {inside}: not {path} mounted"


def test_compose_file_is_valid_for_the_compose_specification():
    """compose-spec (Python bindings of the Rust compose_spec parser) validates the file against
    the Compose Specification without a docker daemon: unknown keys, bad ports, volumes and
    durations are errors. It does not check that depends_on names a service; the test does."""
    import compose_spec  # a test extra (pyproject.toml), so always there under `make test`

    parsed = compose_spec.PyCompose.from_yaml(COMPOSE.read_text())
    names = set(parsed.service_names())
    assert names == {"coordinator", "prometheus", "alertmanager", "grafana"}
    for name, service in load(COMPOSE)["services"].items():
        needs = service.get("depends_on", [])
        assert set(needs) <= names, f"{name} depends on {set(needs) - names}, which are not services"


def test_docker_compose_config_accepts_the_file(tmp_path):
    # optional (not a `tool`: .ci/install-tools does not install docker): the other compose tests
    # check the file without it
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        timeout=30).returncode != 0:
        pytest.skip("docker compose (the plugin) is not installed")
    run(docker, "compose", "-f", str(COMPOSE), "config", "--quiet",
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NANGUARD_TOKEN": "test"})


# --------------------------------------------------------------------------- .ci/install-tools
def test_install_tools_script_passes_shellcheck_and_names_the_packages(tool):
    script = REPO / ".ci" / "install-tools"
    run(tool("shellcheck"), str(script))
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert script.stat().st_mode & 0o111, "not executable"
    for package in ("prometheus", "prometheus-alertmanager", "shellcheck"):
        assert re.search(rf"PACKAGES=\(.*\b{package}\b", text), package
    assert "policy-rc.d" in text and "exit 101" in text
