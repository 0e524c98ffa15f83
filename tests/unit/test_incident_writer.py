"""One incident across ranks (``capture_incident``), with collectives faked in memory: ranks are
threads, or one rank is driven by scripted replies. No torch.distributed anywhere."""

import logging
import os
import threading

import pytest
import torch

from nanguard import _dist
from nanguard import incident as capture
from nanguard.incident import IncidentError, read_incident
from test_capture import first_event

_EXCHANGE_TIMEOUT_S = 10.0  # a rank that skips a collective breaks the barrier instead of hanging it
_SHARDED = "fsdp2: each rank's state.pt holds its own shards"


class Exchange:
    """An in-memory process group for threads: every collective is an all-gather through slots."""

    def __init__(self, world_size):
        self.slots = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=_EXCHANGE_TIMEOUT_S)

    def gather(self, rank, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()  # no rank refills a slot before every rank has read them all
        return gathered


class ThreadCollectives:
    """One rank's view of an ``Exchange``; ``calls`` lists the collectives it took part in."""

    active = True

    def __init__(self, exchange, rank):
        self.exchange = exchange
        self.rank = rank
        self.world_size = len(exchange.slots)
        self.calls = []

    def broadcast_object(self, obj, src=0):
        self.calls.append("broadcast")
        return self.exchange.gather(self.rank, obj)[src]

    def all_gather_object(self, obj):
        self.calls.append("all_gather")
        return self.exchange.gather(self.rank, obj)


class ScriptedCollectives:
    """A lone rank of ``world_size``: broadcasts from another rank and the other ranks' records
    come from a script."""

    active = True

    def __init__(self, rank, world_size, *, broadcasts=(), others=lambda record: []):
        self.rank = rank
        self.world_size = world_size
        self.broadcasts = list(broadcasts)
        self.others = others
        self.calls = []

    def broadcast_object(self, obj, src=0):
        self.calls.append("broadcast")
        return obj if src == self.rank else self.broadcasts.pop(0)

    def all_gather_object(self, obj):
        self.calls.append("all_gather")
        records = self.others(obj)
        records.insert(self.rank, obj)
        return records


def part(rank, **changes):
    """A small rank part: a model state, the step's batch, the RNG and one event."""
    torch.manual_seed(rank)
    fields = dict(model_state={"weight": torch.randn(3, 4), "bias": torch.zeros(3)},
                  optimizer_state={"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
                  extra_states={"scaler": {"scale": 1024.0}},
                  batches=[{"args": (torch.randn(2, 4),), "kwargs": {}}],
                  rng=capture.rng_snapshot(), events=[first_event(rank=rank)],
                  settings={"on_nan": "raise"})
    fields.update(changes)
    return capture.RankPart(**fields)


def collector(rank, parts=None, **changes):
    """A ``collect`` for rank ``rank``; what it returns is kept in ``parts``."""
    def collect():
        made = part(rank, **changes)
        if parts is not None:
            parts[rank] = made
        return made

    return collect


def capture_on(collectives, root, collect):
    return capture.capture_incident(collectives, str(root), first_event(), collect, job_id="job/1",
                                    capture_batch=True, sharded=_SHARDED)


def run_ranks(world_size, rank_main):
    """``rank_main(collectives)`` on one thread per rank; returns (results, collectives) by rank."""
    exchange = Exchange(world_size)
    ranks = [ThreadCollectives(exchange, rank) for rank in range(world_size)]
    results, errors = [None] * world_size, []

    def run(collectives):
        try:
            results[collectives.rank] = rank_main(collectives)
        except BaseException as exc:  # noqa: BLE001  # reported by the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,), name=f"rank{c.rank}") for c in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * _EXCHANGE_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a rank hangs in a collective"
    if errors:
        raise errors[0]
    return results, ranks


def assert_incomplete(path):
    with pytest.raises(IncidentError, match="incomplete: no manifest.json"):
        read_incident(path)


@pytest.mark.timeout(30)
def test_both_ranks_write_and_rank_0_finalizes(tmp_path):
    parts = {}
    results, ranks = run_ranks(2, lambda c: capture_on(c, tmp_path, collector(c.rank, parts)))
    assert results[0] == results[1] == os.path.join(str(tmp_path), "job_1-step7")
    assert [c.calls for c in ranks] == [["broadcast", "all_gather", "broadcast"]] * 2
    incident = read_incident(results[0])
    assert (incident.step, incident.world_size) == (7, 2)
    assert incident.first_event.to_dict() == first_event().to_dict()
    assert incident.manifest["sharded"] == _SHARDED and incident.manifest["capture_batch"] is True
    for rank in (0, 1):
        state = incident.rank_state(rank)
        assert torch.equal(state["model"]["weight"], parts[rank].model_state["weight"])
        assert state["extra"] == {"scaler": {"scale": 1024.0}}
        assert torch.equal(incident.rank_batches(rank)[0]["args"][0], parts[rank].batches[0]["args"][0])
        env = incident.environment(rank)
        assert (env["rank"], env["world_size"], env["settings"]) == (rank, 2, {"on_nan": "raise"})
        assert [e.rank for e in incident.rank_events(rank)] == [rank]


def state_dict_fails():
    raise RuntimeError("state_dict failed")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("failing", [0, 1])
@pytest.mark.parametrize("how", ["unpicklable state", "collect raises"])
def test_a_failed_write_on_one_rank_means_no_incident_on_any(tmp_path, caplog, failing, how):
    def rank_main(collectives):
        if collectives.rank != failing:
            collect = collector(collectives.rank)
        elif how == "unpicklable state":
            collect = collector(failing, model_state={"f": lambda: None})
        else:
            collect = state_dict_fails
        return capture_on(collectives, tmp_path, collect)

    results, ranks = run_ranks(2, rank_main)
    assert results == [None, None]
    assert [c.calls for c in ranks] == [["broadcast", "all_gather", "broadcast"]] * 2
    (path,) = [str(p) for p in tmp_path.iterdir()]
    assert sorted(os.listdir(path)) == [f"rank{1 - failing}"]  # nothing of the failed rank is left
    assert_incomplete(path)
    assert f"rank {failing} could not write its part of the incident" in caplog.text


@pytest.mark.timeout(30)
def test_rank_0_cannot_create_the_folder(tmp_path, caplog):
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    parts = {}
    results, ranks = run_ranks(2, lambda c: capture_on(c, root, collector(c.rank, parts)))
    assert results == [None, None] and parts == {}  # nobody collected, nobody wrote
    assert [c.calls for c in ranks] == [["broadcast"]] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
    assert "no incident written: cannot create a folder under" in caplog.text


@pytest.mark.timeout(30)
def test_rank_0_tells_every_rank_when_the_manifest_cannot_be_written(tmp_path, caplog):
    # rank 1 reports a record, but its folder is not where rank 0 looks (a filesystem not shared)
    def rank_1_record(own):
        return [{"rank": 1, "files": {k.replace("rank0", "rank1"): v for k, v in own["files"].items()}}]

    rank0 = ScriptedCollectives(0, 2, others=rank_1_record)
    assert capture_on(rank0, tmp_path, collector(0)) is None
    (path,) = [str(p) for p in tmp_path.iterdir()]
    assert_incomplete(path)
    assert "the incident could not be completed" in caplog.text and "filesystem every node shares" in caplog.text
    # the other side of the same outcome: rank 1 wrote its part, rank 0 then said "not complete"
    rank1 = ScriptedCollectives(1, 2, broadcasts=[str(tmp_path / "other"), False],
                                others=lambda record: [{"rank": 0, "files": {}}])
    os.mkdir(tmp_path / "other")
    assert capture_on(rank1, tmp_path, collector(1)) is None
    assert os.listdir(tmp_path / "other") == ["rank1"]
    assert rank0.calls == rank1.calls == ["broadcast", "all_gather", "broadcast"]


@pytest.mark.timeout(30)
def test_without_a_process_group_a_process_captures_alone(tmp_path, monkeypatch):
    # torchrun announced two ranks, but no process group exists: the collectives reach this process only
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    collectives = _dist.Collectives()
    assert not collectives.active and collectives.world_size == 2
    path = capture_on(collectives, tmp_path, collector(0))
    incident = read_incident(path)
    assert incident.world_size == 1 and incident.environment(0)["world_size"] == 1


@pytest.mark.timeout(30)
def test_a_failed_write_is_logged_with_its_traceback(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="nanguard")
    assert capture_on(ScriptedCollectives(0, 1), tmp_path, state_dict_fails) is None
    (record,) = [r for r in caplog.records if r.name == "nanguard"]
    assert record.exc_info[0] is RuntimeError
