"""The coordinator's metrics: a fresh registry per test, read back with get_sample_value."""

import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from nanguard.coordinator.metrics import (MAX_LABEL_LENGTH, TRANSIENT_PAIRS_UNKNOWN_WORLD, Metrics,
                                          MetricsServer, exposition)
from nanguard.protocol import BAD_MESSAGE_REASONS as BAD_REASONS


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def metrics(registry):
    return Metrics(registry, version="9.9")


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels)


def test_events_split_into_non_finite_and_warnings(registry, metrics):
    metrics.events({("forward", 1): 2, ("grad_norm", 1): 1})
    metrics.events({("forward", 1): 1, ("loss", 0): 1})
    assert value(registry, "nanguard_nonfinite_events_total", kind="forward", rank="1") == 3
    assert value(registry, "nanguard_nonfinite_events_total", kind="loss", rank="0") == 1
    assert value(registry, "nanguard_nonfinite_events_total", kind="grad_norm", rank="1") is None
    assert value(registry, "nanguard_warning_events_total", kind="grad_norm", rank="1") == 1


def test_stops_and_job_state(registry, metrics):
    assert value(registry, "nanguard_stops_total", reason="operator") == 0
    metrics.stop("operator")
    assert value(registry, "nanguard_stops_total", reason="operator") == 1
    assert value(registry, "nanguard_job_stopped") == 1
    metrics.new_job()
    assert value(registry, "nanguard_job_stopped") == 0
    with pytest.raises(ValueError, match="stop reason"):
        metrics.stop("bored")


def test_bad_messages_total_has_no_labels(registry, metrics):
    metrics.bad_message("unauthenticated")
    metrics.bad_message("malformed")
    metrics.bad_message("malformed")
    assert value(registry, "nanguard_bad_messages_total") == 3
    assert value(registry, "nanguard_bad_message_reasons_total", reason="malformed") == 2
    assert all(value(registry, "nanguard_bad_message_reasons_total", reason=r) is not None for r in BAD_REASONS)
    with pytest.raises(ValueError):
        metrics.bad_message("free text")


def test_dropped_events_count_by_rank(registry, metrics):
    metrics.dropped(3, 5)
    metrics.dropped(3, 7)
    metrics.dropped(12, 1)
    assert value(registry, "nanguard_events_dropped_total", rank="3") == 12
    assert value(registry, "nanguard_events_dropped_total", rank="12") == 1
    with pytest.raises(ValueError, match="only grow"):
        metrics.dropped(3, -1)


def test_incidents_are_distinct_by_folder_name(registry, metrics):
    metrics.incident("/a/incidents/job-step25")
    metrics.incident("/b/other/mount/job-step25/")  # another rank's view of the same incident
    metrics.incident("relative/job-step30")
    assert value(registry, "nanguard_incidents_total") == 2


def test_rank_gauges_are_read_from_the_rows_followed_at_each_scrape(registry, metrics):
    rows = [SimpleNamespace(rank=4, last_seen=1000.0, step=17, step_time_s=0.5, grad_norm=2.0),
            SimpleNamespace(rank=5, last_seen=1001.0, step=None, step_time_s=None, grad_norm=None)]
    assert value(registry, "nanguard_rank_step", rank="4") is None  # nothing followed yet
    metrics.rank_gauges.follow(lambda: list(rows))
    assert value(registry, "nanguard_rank_step", rank="4") == 17
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="4") == 1000
    assert value(registry, "nanguard_rank_step_time_seconds", rank="4") == 0.5
    assert value(registry, "nanguard_rank_grad_norm", rank="4") == 2
    # a value the rank never reported has no series
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="5") == 1001
    assert value(registry, "nanguard_rank_step", rank="5") is None
    rows[0].last_seen = 1002.0
    assert value(registry, "nanguard_rank_last_seen_timestamp_seconds", rank="4") == 1002
    rows.clear()  # a new job: the table is empty
    assert value(registry, "nanguard_rank_step", rank="4") is None
    metrics.ranks(registered=4, alive=2, stalled=1, finished=1)
    assert (value(registry, "nanguard_ranks_registered"), value(registry, "nanguard_ranks_alive"),
            value(registry, "nanguard_ranks_stalled"), value(registry, "nanguard_ranks_finished")) == (4, 2, 1, 1)


def test_per_rank_series_in_both_text_formats(registry, metrics):
    """What Prometheus reads (it asks for OpenMetrics first): each family once, typed, every sample
    with its labels; a family's samples can be read more than once (``name[]`` restricts them)."""
    metrics.rank_gauges.follow(lambda: [SimpleNamespace(rank=7, last_seen=5.0, step=3, step_time_s=None,
                                                        grad_norm=float("nan"))])
    metrics.events({("forward", 7): 2})
    metrics.dropped(7, 4)
    text = generate_latest(registry).decode()
    assert "# TYPE nanguard_rank_step gauge\nnanguard_rank_step{rank=\"7\"} 3.0\n" in text
    assert 'nanguard_rank_grad_norm{rank="7"} NaN' in text
    assert "# TYPE nanguard_nonfinite_events_total counter\n" in text
    assert 'nanguard_nonfinite_events_total{kind="forward",rank="7"} 2.0' in text
    assert 'nanguard_events_dropped_total{rank="7"} 4.0' in text
    families = {family.name: family for family in text_string_to_metric_families(
        openmetrics.generate_latest(registry).decode())}
    assert families["nanguard_nonfinite_events"].type == "counter"
    assert [(s.name, s.labels, s.value) for s in families["nanguard_nonfinite_events"].samples] == [
        ("nanguard_nonfinite_events_total", {"kind": "forward", "rank": "7"}, 2)]
    assert [s.value for s in families["nanguard_rank_last_seen_timestamp_seconds"].samples] == [5]
    only = generate_latest(registry.restricted_registry(["nanguard_rank_step"])).decode()
    assert 'nanguard_rank_step{rank="7"} 3.0' in only and "nanguard_rank_grad_norm" not in only


@pytest.mark.parametrize("encoder", [generate_latest, openmetrics.generate_latest], ids=["text", "openmetrics"])
def test_the_endpoint_writes_what_prometheus_client_would(registry, metrics, encoder):
    """``exposition`` writes the per-rank tables' lines itself, and nothing else changes."""
    metrics.rank_gauges.follow(lambda: [SimpleNamespace(rank=r, last_seen=1e9 + r / 3, step=r or None,
                                                        step_time_s=0.125, grad_norm=[float("inf"), 2.5][r % 2])
                                        for r in range(3)])
    metrics.events({("forward", 2): 2, ("spike", 0): 1})
    metrics.dropped(1, 4)
    metrics.transient('node "7"\\a', "cuda:0", world_size=4)
    metrics.stop("operator")
    assert exposition(registry, encoder) == encoder(registry)
    assert b'nanguard_transient_events_total{device="cuda:0",host="node \\"7\\"\\\\a"} 1.0' in encoder(registry)


def test_info_series(registry, metrics):
    assert value(registry, "nanguard_build_info", version="9.9") == 1
    assert value(registry, "nanguard_coordinator_start_time_seconds") > 0


def test_http_endpoint_serves_the_registry(registry, metrics):
    metrics.stop("nonfinite")
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        with urllib.request.urlopen(server.url, timeout=10) as response:
            text = response.read().decode()
    finally:
        server.close()
    assert 'nanguard_stops_total{reason="nonfinite"} 1.0' in text


def test_transient_events_count_by_host_and_device(registry, metrics):
    metrics.transient("gpu-node-7", "cuda:3 GPU-5c1e", world_size=8)
    metrics.transient("gpu-node-7", "cuda:3 GPU-5c1e", 2, world_size=8)
    metrics.transient("gpu-node-2", "cuda:0 GPU-77aa", world_size=8)
    assert value(registry, "nanguard_transient_events_total", host="gpu-node-7", device="cuda:3 GPU-5c1e") == 3
    assert value(registry, "nanguard_transient_events_total", host="gpu-node-2", device="cuda:0 GPU-77aa") == 1


def test_transient_label_values_are_printable_bounded_and_never_empty(registry, metrics):
    metrics.transient("node\x1b[2J", "x" * 1000, world_size=2)
    metrics.transient("", "", world_size=2)
    assert value(registry, "nanguard_transient_events_total", host="node\\x1b[2J", device="x" * MAX_LABEL_LENGTH) == 1
    assert value(registry, "nanguard_transient_events_total", host="unknown", device="unknown") == 1


@pytest.mark.parametrize("world_size, cap", [(2, 8), (None, TRANSIENT_PAIRS_UNKNOWN_WORLD)])
def test_transient_label_pairs_are_capped_and_the_rest_fold_into_other(registry, metrics, world_size, cap):
    for i in range(cap + 5):
        metrics.transient(f"node{i}", "cuda:0", world_size=world_size)
    metrics.transient("node0", "cuda:0", world_size=world_size)  # a pair already kept still counts as itself
    samples = [s for family in registry.collect() if family.name == "nanguard_transient_events"
               for s in family.samples if s.name == "nanguard_transient_events_total"]
    assert len(samples) == cap + 1
    assert value(registry, "nanguard_transient_events_total", host="node0", device="cuda:0") == 2
    assert value(registry, "nanguard_transient_events_total", host=f"node{cap - 1}", device="cuda:0") == 1
    assert value(registry, "nanguard_transient_events_total", host=f"node{cap}", device="cuda:0") is None
    assert value(registry, "nanguard_transient_events_total", host="other", device="other") == 5
