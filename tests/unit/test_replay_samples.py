"""Replay, item 2: which samples of the captured batch make the step non-finite (bisection
within a cap), their ids, the skip file, and what the search must leave untouched."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import nanguard
from nanguard.errors import IncidentError
from nanguard.incident.inspection import main as inspect_main
from nanguard.replay import samples
from replay_script import replay, run

POISONED = (17, 50)


class RootOfFirst(nn.Module):
    """Scales each sample by sqrt of its first feature plus 10: NaN for a sample whose first
    feature is below -10, and for that sample only."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        return self.lin(x) * torch.sqrt(x[:, :1] + 10.0)


class DictModel(nn.Module):
    """Called with the loader's batch, a dict that carries the samples' ids under "index"."""

    def __init__(self, norm: bool = False):
        super().__init__()
        self.body = RootOfFirst()
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.head = nn.Linear(16, 4)

    def forward(self, batch):
        return self.head(self.norm(self.body(batch["x"])))


def poisoned(step: int, size: int = 64, bad=POISONED, at: int = 3):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(size, 8, generator=gen)
    if step == at:
        for i in bad:
            x[i, 0] = -100.0
    index = torch.arange(size) + 1000 * step  # the dataset's indices of the samples
    return {"x": x, "index": index}, torch.randint(0, 4, (size,), generator=gen)


def test_two_poisoned_samples_of_64(monkeypatch, capsys):
    err = run(DictModel, poisoned, init_kwargs={"sample_id_key": "index"})
    assert err is not None and err.event.step == 3
    report = replay(monkeypatch, err.incident, DictModel, poisoned, init_kwargs={"sample_id_key": "index"})
    found = report["samples"]["0"]
    assert found["searched"] and not found["capped"] and found["runs"] <= 30
    (entry,) = found["micro_batches"]
    assert entry["outcome"] == "forward" and entry["checked"] == "every module's output"
    assert entry["bad"] == list(POISONED) and entry["unresolved"] == []
    assert entry["ids"] == [3017, 3050] and entry["rest_clean"] is True
    assert found["mixing"] == []
    assert report["bad_samples"] == [{"rank": 0, "micro_batch": 0, "index": i, "id": 3000 + i} for i in POISONED]
    # the skip file, for the sampler on resume
    assert report["skip_file"] == os.path.join(err.incident, "skip.json")
    assert nanguard.skip_list(err.incident) == {3017, 3050}
    assert nanguard.skip_list(report["skip_file"], err.incident) == {3017, 3050}
    out = capsys.readouterr().out
    assert "2 of 64 samples are bad alone: 17, 50 (ids 3017, 3050); the rest runs clean" in out
    assert inspect_main([err.incident]) == 0
    text = capsys.readouterr().out
    assert "samples      rank 0, micro-batch 0: bad in forward" in text and "skip file" in text


class Wide(nn.Module):
    """A first layer whose output overflows float16 (above 65504) for a sample of large inputs,
    which float32 holds: the fault is the script's autocast's."""

    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        with torch.no_grad():
            self.lin.weight.fill_(1.0)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)))


def large(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.rand(8, 8, generator=gen)
    if step == 2:
        x[5] = 2e4  # finite in float16 (up to 65504); the sum of eight of them is not
    return x, torch.randint(0, 4, (8,), generator=gen)


def test_the_search_runs_under_the_autocast_the_step_ran_in(monkeypatch, capsys):
    half = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    loss = lambda out, y: nn.functional.cross_entropy(out.float(), y)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.float16):  # the oracle: sample 5 alone overflows in float16 only
        assert not torch.isfinite(Wide()(large(2)[0][5:6])).all()
    assert torch.isfinite(Wide()(large(2)[0][5:6])).all()
    err = run(Wide, large, region=half, loss=loss)
    assert err is not None and (err.event.step, err.event.layer) == (2, "lin")
    report = replay(monkeypatch, err.incident, Wide, large, region=half, loss=loss)
    assert report["verdict"] == "reproducible", report["message"]
    found = report["samples"]["0"]
    (entry,) = found["micro_batches"]
    assert (entry["outcome"], entry["bad"], entry["rest_clean"]) == ("forward", [5], True), entry
    assert found["autocast"] == ["cpu float16"]
    assert report["bad_samples"] == [{"rank": 0, "micro_batch": 0, "index": 5, "id": None}]
    assert "under the script's autocast (cpu float16)" in capsys.readouterr().out


def test_ids_named_by_the_environment_and_a_missing_key(monkeypatch):
    err = run(DictModel, poisoned)
    report = replay(monkeypatch, err.incident, DictModel, poisoned, env={"NANGUARD_SAMPLE_ID_KEY": "index"})
    assert report["samples"]["0"]["micro_batches"][0]["ids"] == [3017, 3050]
    report = replay(monkeypatch, err.incident, DictModel, poisoned, env={"NANGUARD_SAMPLE_ID_KEY": "sample"})
    entry = report["samples"]["0"]["micro_batches"][0]
    assert entry["bad"] == list(POISONED) and entry["ids"] is None
    assert "has no 'sample'" in entry["note"]
    assert report["skip_file"] is None
    # the earlier replay's skip.json is still there; without a key there would be none
    report = replay(monkeypatch, err.incident, DictModel, poisoned)
    assert any("no skip file: name the key" in note for note in report["notes"])


def test_the_search_leaves_model_optimizer_and_rng_as_they_were(monkeypatch):
    err = run(lambda: DictModel(norm=True), poisoned)
    seen = {}
    real = samples.search

    def watched(model, batches, rng, **kwargs):
        before = (_state(model), torch.get_rng_state(), [p.grad for p in model.parameters()])
        result = real(model, batches, rng, **kwargs)
        seen.update(before=before, after=(_state(model), torch.get_rng_state(),
                                          [p.grad for p in model.parameters()]))
        return result

    monkeypatch.setattr(samples, "search", watched)
    keep: dict = {}
    report = replay(monkeypatch, err.incident, lambda: DictModel(norm=True), poisoned, keep=keep)
    (state_before, rng_before, grads_before), (state_after, rng_after, grads_after) = seen["before"], seen["after"]
    assert state_before.keys() == state_after.keys()
    # BatchNorm's statistics too (NaN since the replayed step's forward met the bad samples)
    assert all(_same(state_before[k], state_after[k]) for k in state_before)
    assert torch.equal(rng_before, rng_after)
    assert all(a is b for a, b in zip(grads_before, grads_after))  # no .grad written
    assert keep["optimizer"].state_dict()["state"] == {}  # never stepped
    # BatchNorm mixes the samples: said, and what it means for the answer
    (mixing,) = report["samples"]["0"]["mixing"]
    assert "BatchNorm" in mixing and "norm" in mixing and "statistics" in mixing


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_batchnorm_on_one_sample_cannot_run_and_says_so(monkeypatch):
    err = run(lambda: DictModel(norm=True), lambda s: poisoned(s, size=8, bad=(5,)))
    report = replay(monkeypatch, err.incident, lambda: DictModel(norm=True), lambda s: poisoned(s, size=8, bad=(5,)))
    entry = report["samples"]["0"]["micro_batches"][0]
    assert entry["bad"] == []  # never claimed without running a sample alone
    groups = entry["unresolved"]
    assert groups and all("could not run alone: ValueError" in g["why"] for g in groups)
    assert any(g["from"] <= 5 < g["to"] for g in groups)


class SumsTheBatch(nn.Module):
    """Adds the whole batch into each sample: two huge samples overflow only together."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(x) + x.sum(0, keepdim=True)[:, :4]


def together(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=gen)
    if step == 1:
        x[2, 0] = x[12, 0] = 2e38  # finite alone, inf when added
    return x, torch.randint(0, 4, (16,), generator=gen)


def test_samples_bad_only_together(monkeypatch):
    err = run(SumsTheBatch, together)
    assert err is not None and err.event.step == 1
    report = replay(monkeypatch, err.incident, SumsTheBatch, together)
    entry = report["samples"]["0"]["micro_batches"][0]
    assert entry["bad"] == []
    assert entry["unresolved"] == [{"from": 0, "to": 16, "why": entry["unresolved"][0]["why"]}]
    assert entry["unresolved"][0]["why"].startswith("bad only together")


@pytest.mark.parametrize("bad", [(100, 3001), tuple(range(4096))], ids=["two", "all"])
def test_a_batch_of_4096_is_searched_within_the_cap(bad):
    model = RootOfFirst()
    x = torch.randn(4096, 8)
    x[list(bad), 0] = -100.0
    batch = {"args": (x,), "kwargs": {}}
    found = samples.search(model, [batch], {"python": __import__("random").getstate(), "numpy": None,
                                            "torch": torch.get_rng_state(), "cuda": []},
                           key=None, skipped=set())
    assert found["runs"] <= samples.MAX_RUNS
    (entry,) = found["micro_batches"]
    if len(bad) == 2:
        assert entry["bad"] == list(bad) and not found["capped"] and entry["rest_clean"] is True
    else:
        assert found["capped"] and entry["unresolved"]
        assert all("cap of 64 runs" in g["why"] for g in entry["unresolved"])
        assert len(entry["bad"]) < 64  # what was found alone, nothing more


def test_skip_list_refuses_what_it_cannot_trust(tmp_path):
    (tmp_path / "incident").mkdir()
    good = tmp_path / "skip.json"
    good.write_text(json.dumps({"format": "nanguard-skip", "version": 1, "ids": [1, "a"]}))
    assert nanguard.skip_list(good) == {1, "a"}
    for bad in ({"format": "other"}, {"format": "nanguard-skip", "version": 2, "ids": []},
                {"format": "nanguard-skip", "version": 1, "ids": [True]}, [1, 2]):
        good.write_text(json.dumps(bad))
        with pytest.raises(IncidentError, match="is not a skip file nanguard wrote"):
            nanguard.skip_list(good)
    good.write_text("{")
    with pytest.raises(IncidentError, match="could not be read as a skip file"):
        nanguard.skip_list(good)
    with pytest.raises(IncidentError, match="NANGUARD_SAMPLE_ID_KEY"):
        nanguard.skip_list(tmp_path / "incident")  # a folder without skip.json
    with pytest.raises(TypeError):
        nanguard.skip_list()


def test_ids_are_found_in_keywords_fields_and_lists():
    batch = {"args": (), "kwargs": {"x": torch.zeros(3, 2), "sample_id": ["a", "b", "c"]}}
    assert samples.sample_ids(batch, "sample_id", 3) == (["a", "b", "c"], None)
    assert samples.sample_ids({"args": ({"inner": {"idx": torch.tensor([4, 5, 6])}},), "kwargs": {}}, "idx", 3)[0] == [4, 5, 6]
    ids, why = samples.sample_ids({"args": ({"idx": torch.zeros(2, 3)},), "kwargs": {}}, "idx", 3)
    assert ids is None and "one id per sample" in why
    whole = {"args": (torch.zeros(4, 2), torch.ones(7)), "kwargs": {"mask": torch.ones(4, 4)}}
    half = samples.part(whole, [1, 3], 4)
    assert half["args"][0].shape == (2, 2) and half["args"][1].shape == (7,) and half["kwargs"]["mask"].shape == (2, 4)


class UnusedNorm(nn.Module):
    """A BatchNorm registered but never called: nothing mixes the samples."""

    def __init__(self):
        super().__init__()
        self.body = RootOfFirst()
        self.unused = nn.BatchNorm1d(16)

    def forward(self, x):
        return self.body(x)


def test_a_batchnorm_that_never_ran_is_not_named(monkeypatch):
    batch = lambda s: poisoned(s, size=8, bad=(5,))  # noqa: E731
    err = run(UnusedNorm, lambda s: (batch(s)[0]["x"], batch(s)[1]))
    report = replay(monkeypatch, err.incident, UnusedNorm, lambda s: (batch(s)[0]["x"], batch(s)[1]))
    found = report["samples"]["0"]
    assert found["micro_batches"][0]["bad"] == [5]
    assert found["mixing"] == []


class Dropped(nn.Module):
    """0/0 where dropout zeroed an element: a sample is bad under the step's own masks only."""

    def __init__(self):
        super().__init__()
        self.drop, self.fc = nn.Dropout(0.05), nn.Linear(8, 4)

    def forward(self, x):
        h = self.drop(x[:, :4])
        return self.fc(torch.cat([x[:, 4:], h / h], 1))


def positive(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.rand(8, 8, generator=gen) + 0.5, torch.randint(0, 4, (8,), generator=gen)


def test_dropout_redrawn_for_each_part_is_said(monkeypatch, capsys):
    err = run(Dropped, positive)
    assert err is not None
    report = replay(monkeypatch, err.incident, Dropped, positive)
    found = report["samples"]["0"]
    (note,) = found["mixing"]
    assert "random numbers in train mode (drop)" in note and "drawn anew for each part's shape" in note
    together = [g for g in found["micro_batches"][0]["unresolved"] if g["why"].startswith("bad only together")]
    assert together  # the masks moved: parts bad whole, neither half bad
    assert all("drop in train mode draw(s) random masks anew" in g["why"] for g in together)
    assert "caveat: 1 module(s) that draw random numbers" in capsys.readouterr().out


class TwoHeads(nn.Module):
    """A backward-only fault (sqrt's gradient at 0) through ``main`` for a sample with x[:, 1] == 0,
    and through ``aux``, which the script's loss never uses, for one with x[:, 2] == 0."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, batch):
        s = batch["x"] * self.scale
        return self.fc(batch["x"]) + torch.sqrt(s[:, 1:2]), torch.sqrt(s[:, 2:3])


def two_heads(step: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.rand(8, 4, generator=gen) + 0.5
    if step == 1:
        x[3, 1] = x[6, 2] = 0.0
    return {"x": x, "index": torch.arange(8) + 100 * step}, torch.randint(0, 4, (8,), generator=gen)


def main_only(out, y):
    return nn.functional.cross_entropy(out[0], y)


def test_the_backward_goes_into_the_outputs_the_loss_used(monkeypatch, capsys):
    kwargs = {"init_kwargs": {"sample_id_key": "index"}, "loss": main_only}
    err = run(TwoHeads, two_heads, **kwargs)
    assert err is not None and err.event.step == 1
    report = replay(monkeypatch, err.incident, TwoHeads, two_heads, **kwargs)
    found = report["samples"]["0"]
    assert found["outputs"] == [0]
    (entry,) = found["micro_batches"]
    assert entry["outcome"] == "backward" and entry["bad"] == [3] and entry["suspects"] == []
    assert "received a gradient in the step's backward (output(s) 0 of its 2" in entry["checked"]
    assert entry["rest_clean"] is True
    assert report["bad_samples"] == [{"rank": 0, "micro_batch": 0, "index": 3, "id": 103}]
    assert nanguard.skip_list(err.incident) == {103}  # sample 6 (id 106) is harmless for this loss
    capsys.readouterr()


def test_a_backward_into_every_output_names_suspects_only():
    """Where the outputs the loss used are not known, a sample bad alone only in a backward into
    every output is a suspect, not a bad sample."""
    x = two_heads(1)[0]
    batch = {"args": (x,), "kwargs": {}}
    rng = {"python": __import__("random").getstate(), "numpy": None, "torch": torch.get_rng_state(), "cuda": []}
    unknown = samples.search(TwoHeads(), [batch], rng, key="index", skipped=set())
    (entry,) = unknown["micro_batches"]
    assert entry["outcome"] == "backward" and entry["checked"] == samples.CHECKED[True]
    assert entry["bad"] == [] and entry["ids"] == [] and entry["suspects"] == [3, 6]
    assert entry["suspect_ids"] == [103, 106] and entry["rest_clean"] is True
    from nanguard.incident.replay_lines import sample_lines
    assert "2 sample(s) bad alone only in a backward into every output" in " ".join(sample_lines(unknown))
    known = samples.search(TwoHeads(), [batch], rng, key="index", skipped=set(), outputs=[0])
    (entry,) = known["micro_batches"]
    assert entry["bad"] == [3] and entry["ids"] == [103] and entry["suspects"] == []


def test_a_clean_search_says_its_check_is_not_the_steps_own():
    # a micro-batch the replay reproduced can run clean under the search's backward of ones (a NaN born
    # in the loss's gradient): the line must not read as if the step itself ran clean
    from nanguard.incident.replay_lines import sample_lines

    found = {"searched": True, "micro_batches": [{"micro_batch": 0, "outcome": "clean", "unresolved": []}],
             "runs": 1, "max_runs": 64, "capped": False}
    (line, _) = sample_lines(found)
    assert line.startswith("micro-batch 0: clean under the search's own check") and "not of the step's loss" in line
