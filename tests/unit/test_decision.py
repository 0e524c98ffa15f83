"""The step decision across ranks, with a process group made of threads (tests/unit/fake_group.py):
every rank bad, one rank bad, a stop requested on one rank, a capture failing on one rank.
Every rank must take the same decision at the same step, and none may hang."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_mlp, train_step
from fake_group import ThreadGroup

import nanguard
from nanguard.config import Settings
from nanguard.incident import read_incident
from nanguard.rank.decision import agree, read_step
from nanguard.rank.reading import Finding
from nanguard.rank.guard import Guard
from nanguard.rank.reporter import Reporter

pytestmark = pytest.mark.timeout(120)


class StopAsked(Reporter):
    """A coordinator link on which a stop command arrives after ``after`` steps."""

    def __init__(self, after: int = 0):
        self.stops = []
        self.heartbeats = []
        self._after = after
        self._pending = ("maintenance", "operator") if after == 0 else None

    def heartbeat(self, step, step_time_s, grad_norm):
        self.heartbeats.append(step)
        if len(self.heartbeats) == self._after:
            self._pending = ("maintenance", "operator")

    @property
    def stop_requested(self) -> bool:
        return self._pending is not None

    def take_stop(self):
        taken, self._pending = self._pending, None
        return taken

    def stopped(self, step, reason):
        self.stops.append((step, reason))


class Broken:
    """A scheduler whose state cannot be saved: this rank's part of the incident fails."""

    def state_dict(self):
        raise RuntimeError("cannot save this scheduler")


def train(collectives, *, bad_ranks=(), bad_step=2, steps=4, reporter=None, broken_ranks=(), tmp=None,
          on_nan="raise"):
    """One rank: train an MLP under a guard on the fake group; what happened, for asserts."""
    torch.manual_seed(0)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = {"scheduler": Broken()} if collectives.rank in broken_ranks else {}
    settings = Settings.resolve({"dir": str(tmp), "on_nan": on_nan}, environ={})
    guard = Guard(model, [optimizer], settings, states=states, collectives=collectives,
                  reporter=reporter(collectives.rank) if reporter else None)
    generator = torch.Generator().manual_seed(collectives.rank)
    before = None
    try:
        for step in range(steps):
            model[2].armed = bad_step in (step, "every") and collectives.rank in bad_ranks
            before = copy.deepcopy(model.state_dict())
            train_step(model, optimizer, guard, x=torch.randn(5, 8, generator=generator))
        return {"completed": guard.step}
    except (nanguard.NonFiniteError, nanguard.StopRequested) as err:
        unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        return {"error": err, "step": guard.step, "unchanged": unchanged, "events": guard.events}
    finally:
        guard.close()


def test_one_bad_rank_stops_every_rank_at_the_same_step_with_its_event(tmp_path):
    results = ThreadGroup(2).run(lambda c: train(c, bad_ranks=(1,), tmp=tmp_path))
    for rank, result in enumerate(results):
        error = result["error"]
        assert isinstance(error, nanguard.NonFiniteError), (rank, result)
        assert error.event.rank == 1 and error.event.step == 2 and error.event.layer == "2"
        assert result["unchanged"], f"rank {rank}'s update was applied"
    assert results[0]["error"].incident == results[1]["error"].incident
    incident = read_incident(results[0]["error"].incident)
    assert incident.world_size == 2 and incident.first_event.rank == 1
    # rank 0 keeps the job's first event although it saw nothing itself
    assert [e.rank for e in results[0]["events"]] == [1]


def test_every_rank_bad_agrees_on_the_lowest_rank(tmp_path):
    results = ThreadGroup(3).run(lambda c: train(c, bad_ranks=(0, 1, 2), tmp=tmp_path))
    events = [r["error"].event for r in results]
    assert {e.rank for e in events} == {0} and {e.step for e in events} == {2}
    # each rank keeps what it saw itself beside the job's first event
    assert sorted({e.rank for e in results[2]["events"]}) == [0, 2]


def test_a_stop_requested_on_one_rank_stops_every_rank_at_one_step(tmp_path):
    reporters = {0: StopAsked()}
    results = ThreadGroup(2).run(lambda c: train(c, reporter=lambda r: reporters.get(r), tmp=tmp_path))
    for result in results:
        assert isinstance(result["error"], nanguard.StopRequested)
        assert result["error"].step == 0 and result["unchanged"]
    assert results[0]["error"].reason == "maintenance"
    assert results[1]["error"].reason == "requested by the coordinator through another rank"
    assert reporters[0].stops == [(0, "operator")]


def test_a_capture_failing_on_one_rank_leaves_no_incident_and_no_hang(tmp_path):
    results = ThreadGroup(2).run(lambda c: train(c, bad_ranks=(0,), broken_ranks=(1,), tmp=tmp_path))
    for result in results:
        assert isinstance(result["error"], nanguard.NonFiniteError)
        assert result["error"].incident is None and result["unchanged"]
    assert not list(tmp_path.rglob("manifest.json"))


def test_read_step_and_agree_without_a_model():
    group = ThreadGroup(2)

    def rank(c):
        probes = [torch.tensor(1.0), torch.tensor(float("nan") if c.rank == 1 else 2.0)]
        reading = read_step(probes, [torch.tensor(3.0)], [], c, early=False, stop=False, watches_buckets=False)
        event = nanguard.Event(kind="forward", rank=c.rank, step=0, layer=f"l{c.rank}")
        local = Finding(event) if c.rank == 1 else None
        return reading, agree(c, local)

    (r0, f0), (r1, f1) = group.run(rank)
    assert r0.bad and r1.bad and not r0.stop
    assert r0.probes == [1.0, 2.0] and r0.norms == [3.0]  # each rank reads its own values
    assert f0.event.layer == f1.event.layer == "l1"


@pytest.mark.parametrize("positions, first", [({0: (0, 7), 1: (0, 3)}, 1), ({0: (0, 9), 1: (1, 0)}, 0),
                                               ({0: (0, 3), 1: (0, 3)}, 0)],
                         ids=["earlier output", "earlier micro-batch", "same place: lowest rank"])
def test_the_forward_finding_seen_earliest_in_the_step_is_the_jobs_first(positions, first):
    # a norm that all-reduces batch statistics spreads a NaN born on rank 1 to rank 0, where it is
    # seen later in the step (at the norm, not at the module that made it): rank 1's is the first
    def rank(c):
        event = nanguard.Event(kind="forward", rank=c.rank, step=2, layer=f"l{c.rank}")
        return agree(c, Finding(event, position=positions[c.rank]))

    assert [f.event.rank for f in ThreadGroup(2).run(rank)] == [first, first]


@pytest.mark.parametrize("policy", ["warn", "skip"])
def test_a_stop_requested_during_a_nan_storm_stops_every_rank(tmp_path, policy):
    # every step is bad on rank 1 and the policy lets training go on: a stop must still stop it
    reporters = {0: StopAsked(after=3)}
    results = ThreadGroup(2).run(lambda c: train(c, bad_ranks=(1,), bad_step="every", steps=50,
                                                 on_nan=policy, reporter=lambda r: reporters.get(r),
                                                 tmp=tmp_path))
    for result in results:
        assert isinstance(result["error"], nanguard.StopRequested), result
        assert result["error"].step == 3 and result["step"] == 4
    # the bad steps were reported as steps: the rank's progress does not freeze
    assert reporters[0].heartbeats == [0, 1, 2, 3]
