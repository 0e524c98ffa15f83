"""deploy/k8s: built-in kinds against the Kubernetes schemas (kubernetes-validate, offline, strict),
the CRD kinds against what their operators require, and the references between the manifests."""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
VERSIONS = ["1.30.0", "latest"]  # the oldest Kubernetes these manifests claim, and the newest bundled
COORDINATOR_PORTS = {"zmq": 5555, "metrics": 9464}


def need(module: str):
    """Import a test dependency: skipped locally without it, a failure where CI must have it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        message = f"{module} is not installed (the test extras install it)"
        if os.environ.get("CI_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, dict]]:
    yaml = need("yaml")
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                found.append((path.name, doc))
    return found


def of_kind(docs, kind: str, file: str | None = None) -> list[dict]:
    return [d for f, d in docs if d["kind"] == kind and (file is None or f == file)]


def named(docs, kind: str, name: str) -> dict:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} defined"
    return found[0]


def pod_templates(docs) -> list[tuple[str, dict]]:
    """(owner, pod template) of every workload."""
    out = []
    for _, d in docs:
        owner = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            out.append((owner, d["spec"]["template"]))
        elif d["kind"] == "PyTorchJob":
            for replica, spec in d["spec"]["pytorchReplicaSpecs"].items():
                out.append((f"{owner}/{replica}", spec["template"]))
    return out


def selects(selector: dict, labels: dict) -> bool:
    """A Service's selector or a LabelSelector (matchLabels only) against pod labels."""
    if "matchLabels" in selector or "matchExpressions" in selector:
        assert "matchExpressions" not in selector, "matchExpressions are not checked here"
        selector = selector["matchLabels"]
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def flag(command: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(name + "=")]
    assert len(values) == 1, f"{name}= once in {command}"
    return values[0]


def coordinator_template(docs) -> dict:
    return named(docs, "Deployment", "example-job-nanguard")["spec"]["template"]


def rank_templates(docs) -> list[tuple[str, dict]]:
    return [(o, t) for o, t in pod_templates(docs) if t["metadata"]["labels"].get("nanguard/role") == "rank"]


def walk(value, key: str):
    """Every value under ``key`` anywhere in a document."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == key:
                yield v
            yield from walk(v, key)
    elif isinstance(value, list):
        for v in value:
            yield from walk(v, key)


# -- schemas ---------------------------------------------------------------------------------

CRDS = {("kubeflow.org/v1", "PyTorchJob"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.mark.parametrize("version", VERSIONS)
def test_builtin_kinds_validate_strictly(docs, version):
    kv = need("kubernetes_validate")
    if version == "latest":
        version = kv.utils.latest_version() + ".0"
    checked = 0
    for file, doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{file}: {doc['kind']}/{doc['metadata']['name']} at "
                        f"{'.'.join(map(str, exc.path))}: {exc.message}")
        except kv.SchemaNotFoundError:
            pytest.fail(f"{file}: no schema for {doc['apiVersion']} {doc['kind']} in Kubernetes {version}; "
                        "a CRD kind needs its own checks here")
        checked += 1
    assert checked >= 7


def test_crd_pod_templates_validate_as_pod_templates(docs):
    kv = need("kubernetes_validate")
    for job in of_kind(docs, "PyTorchJob"):
        for replica, spec in job["spec"]["pytorchReplicaSpecs"].items():
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": replica.lower()},
                       "template": spec["template"]}
            for version in ("1.30.0", kv.utils.latest_version() + ".0"):
                try:
                    kv.validate(wrapped, version, strict=True)
                except kv.ValidationError as exc:
                    where = ".".join(map(str, exc.path))
                    pytest.fail(f"PyTorchJob {replica} template at {where}: {exc.message}")


def test_the_validator_rejects_an_unknown_field(docs):
    kv = need("kubernetes_validate")
    bad = json.loads(json.dumps(named(docs, "Deployment", "example-job-nanguard")))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kv.ValidationError, match="imagePullPolcy"):
        kv.validate(bad, "1.30.0", strict=True)


DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def test_pytorchjob_as_the_training_operator_validates_it(docs):
    jobs = of_kind(docs, "PyTorchJob")
    assert len(jobs) == 1
    job = jobs[0]
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert DNS_1035.match(job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    spec = job["spec"]
    assert set(spec) <= {"runPolicy", "elasticPolicy", "pytorchReplicaSpecs", "nprocPerNode"}, set(spec)
    assert not (spec.get("nprocPerNode") and spec.get("elasticPolicy", {}).get("nProcPerNode"))
    assert isinstance(spec.get("nprocPerNode", "auto"), str)
    run_policy = spec.get("runPolicy", {})
    assert set(run_policy) <= {"cleanPodPolicy", "ttlSecondsAfterFinished", "activeDeadlineSeconds",
                               "backoffLimit", "schedulingPolicy", "suspend", "managedBy"}
    assert run_policy.get("cleanPodPolicy", "None") in ("All", "Running", "None")
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    for name, replica in replicas.items():
        assert set(replica) <= {"replicas", "template", "restartPolicy"}, set(replica)
        assert isinstance(replica["replicas"], int) and replica["replicas"] >= 1
        assert replica.get("restartPolicy", "OnFailure") in ("Always", "OnFailure", "Never", "ExitCode")
        pods = containers(replica["template"])
        assert pods and all(c.get("name") and c.get("image") for c in pods)
        assert "pytorch" in [c["name"] for c in pods], f"{name}: the operator needs a container named pytorch"
    assert replicas["Master"]["replicas"] == 1


def test_pytorchjob_torchrun_matches_the_replicas(docs):
    job = of_kind(docs, "PyTorchJob")[0]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    for name, replica in replicas.items():
        command = [c for c in containers(replica["template"]) if c["name"] == "pytorch"][0]["command"]
        assert command[0] == "torchrun"
        assert int(flag(command, "--nnodes")) == sum(r["replicas"] for r in replicas.values())
        assert flag(command, "--nproc-per-node") == job["spec"]["nprocPerNode"]
        # variables the operator sets in every pod, expanded by the kubelet
        assert flag(command, "--node-rank") == "$(RANK)"
        assert flag(command, "--master-addr") == "$(MASTER_ADDR)"
        assert flag(command, "--master-port") == "$(MASTER_PORT)"


def test_indexed_job_rendezvous_through_its_headless_service(docs):
    job = named(docs, "Job", "example-job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    template = spec["template"]
    service = named(docs, "Service", template["spec"]["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert selects(service["spec"]["selector"], template["metadata"]["labels"])
    others = [o for o, t in pod_templates(docs) if t is not template and selects(service["spec"]["selector"],
                                                                                  t["metadata"]["labels"])]
    assert not others, f"the headless Service also selects {others}"
    (container,) = containers(template)
    command = container["command"]
    assert int(flag(command, "--nnodes")) == spec["completions"]
    assert flag(command, "--master-addr") == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    port = int(flag(command, "--master-port"))
    assert port in [p["port"] for p in service["spec"]["ports"]]
    assert port in [p["containerPort"] for p in container["ports"]]
    rank = flag(command, "--node-rank")
    assert rank == "$(NODE_RANK)"
    assert env(container)["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def test_servicemonitor_selects_the_metrics_service_by_a_named_port(docs):
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["name"]
    spec = monitor["spec"]
    assert spec["selector"].get("matchLabels")
    assert spec["endpoints"]
    services = [s for s in of_kind(docs, "Service")
                if selects(spec["selector"], s["metadata"].get("labels", {}))]
    assert [s["metadata"]["name"] for s in services] == ["example-job-nanguard-metrics"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels"}
        assert endpoint["path"] == "/metrics" and endpoint.get("scheme", "http") == "http"
        assert re.fullmatch(r"\d+[smh]", endpoint.get("interval", "30s"))
        (port,) = [p for p in services[0]["spec"]["ports"] if p.get("name") == endpoint["port"]]
        assert port["port"] == COORDINATOR_PORTS["metrics"]


# -- references between the manifests ---------------------------------------------------------


def test_every_secret_reference_is_to_the_documented_secret(docs):
    readme = (K8S / "README.md").read_text()
    refs = [(ref["name"], ref["key"]) for _, d in docs for ref in walk(d, "secretKeyRef")]
    assert refs
    defined = {s["metadata"]["name"]: set(s.get("data", {})) | set(s.get("stringData", {}))
               for s in of_kind(docs, "Secret")}
    for name, key in set(refs):
        if name in defined:
            assert key in defined[name], f"Secret {name} has no key {key}"
        else:
            assert f"kubectl create secret generic {name} --from-literal={key}=" in readme, (
                f"Secret {name} (key {key}) is neither defined nor documented in deploy/k8s/README.md")


def test_every_claim_is_defined(docs):
    claims = {c["claimName"] for _, d in docs for c in walk(d, "persistentVolumeClaim")}
    assert claims
    for claim in claims:
        named(docs, "PersistentVolumeClaim", claim)


def test_every_service_selects_pods_and_their_ports(docs):
    templates = pod_templates(docs)
    for service in of_kind(docs, "Service"):
        name = service["metadata"]["name"]
        matched = [t for _, t in templates if selects(service["spec"]["selector"], t["metadata"]["labels"])]
        assert matched, f"Service {name} selects no pod template"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for template in matched:
                ports = [p for c in containers(template) for p in c.get("ports", [])]
                if isinstance(target, str):
                    assert target in [p.get("name") for p in ports], f"Service {name}: no port named {target}"
                else:
                    assert target in [p["containerPort"] for p in ports], f"Service {name}: no port {target}"


def test_workload_selectors_match_their_templates(docs):
    for deployment in of_kind(docs, "Deployment"):
        assert selects(deployment["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])


def test_coordinator_ports_agree_with_its_image():
    dockerfile = (REPO / "docker" / "Dockerfile.coordinator").read_text().splitlines()
    entry = json.loads(next(line for line in dockerfile if line.startswith("ENTRYPOINT"))[len("ENTRYPOINT"):])
    assert entry[entry.index("--bind") + 1].endswith(f":{COORDINATOR_PORTS['zmq']}")
    assert int(entry[entry.index("--metrics-port") + 1]) == COORDINATOR_PORTS["metrics"]


def test_coordinator_pod(docs):
    deployment = named(docs, "Deployment", "example-job-nanguard")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    (container,) = containers(deployment["spec"]["template"])
    assert "nanguard-coordinator:" in container["image"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == COORDINATOR_PORTS
    assert "NANGUARD_TOKEN" in env(container)
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/var/lib/nanguard" in mounts  # the image's log folder, on the shared claim


def test_network_policy_admits_the_ranks_and_prometheus_only(docs):
    (policy,) = of_kind(docs, "NetworkPolicy")
    spec = policy["spec"]
    coordinator = coordinator_template(docs)
    assert selects(spec["podSelector"], coordinator["metadata"]["labels"])
    ranks = rank_templates(docs)
    assert {o.split("/")[0] for o, _ in ranks} == {"PyTorchJob", "Job"}
    for _, template in ranks:
        assert not selects(spec["podSelector"], template["metadata"]["labels"])
    assert spec["policyTypes"] == ["Ingress"]
    by_port = {}
    for rule in spec["ingress"]:
        (port,) = rule["ports"]
        assert port.get("protocol", "TCP") == "TCP"
        by_port[port["port"]] = rule["from"]
    assert set(by_port) == set(COORDINATOR_PORTS.values())
    (peer,) = by_port[COORDINATOR_PORTS["zmq"]]
    assert set(peer) == {"podSelector"}  # this namespace's pods, no others
    for owner, template in ranks:
        assert selects(peer["podSelector"], template["metadata"]["labels"]), f"{owner}: no way in"
    assert not selects(peer["podSelector"], coordinator["metadata"]["labels"])
    (prometheus,) = by_port[COORDINATOR_PORTS["metrics"]]
    assert set(prometheus) == {"namespaceSelector", "podSelector"}
    assert prometheus["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


def test_ranks_point_at_the_coordinator_service_with_token_and_shared_dir(docs):
    coordinator = coordinator_template(docs)
    (coordinator_container,) = containers(coordinator)
    coordinator_ports = {p["name"]: p["containerPort"] for p in coordinator_container["ports"]}
    claim = coordinator["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    job_id = coordinator_container["args"][coordinator_container["args"].index("--job") + 1]
    ranks = rank_templates(docs)
    assert len(ranks) == 3  # PyTorchJob Master and Worker, Indexed Job
    for owner, template in ranks:
        (container,) = containers(template)
        variables = env(container)
        assert "nanguard-train:" in container["image"]
        address = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", variables["NANGUARD_COORDINATOR"]["value"])
        assert address, variables["NANGUARD_COORDINATOR"]
        service = named(docs, "Service", address.group(1))
        assert selects(service["spec"]["selector"], coordinator["metadata"]["labels"]), owner
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(address.group(2))]
        target = port["targetPort"]
        assert coordinator_ports.get(target, target) == COORDINATOR_PORTS["zmq"], owner
        ref = variables["NANGUARD_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == coordinator_container["env"][0]["valueFrom"]["secretKeyRef"], owner
        incidents = variables["NANGUARD_DIR"]["value"]
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounted = [m for m in container["volumeMounts"]
                   if incidents.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounted, f"{owner}: NANGUARD_DIR {incidents} is on no volume"
        assert volumes[mounted[0]["name"]]["persistentVolumeClaim"]["claimName"] == claim, owner
        assert flag(container["command"], "--rdzv-id") == job_id, f"{owner}: the coordinator serves {job_id}"
        assert container["command"][-1] and (REPO / container["command"][-1]).is_file()


def test_images_are_pinned(docs):
    for _, d in docs:
        for image in walk(d, "image"):
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), image
