"""The public surface, bad use, installing and removing hooks, the one-read-per-step budget."""

import math
import os
import sys

import pytest
import torch
from torch import nn

import nanguard
from conftest import make_mlp, train_step


def test_public_names_are_locked():
    assert nanguard.__all__ == sorted(nanguard.__all__)
    assert nanguard.__all__ == [
        "ConfigError", "Event", "Guard", "GuardClosedError", "NanguardError", "NonFiniteError",
        "ProtocolError", "ReplayFinished", "StopRequested", "destroy_process_group", "init",
        "skip_list",
    ]
    assert issubclass(nanguard.NonFiniteError, RuntimeError)
    assert issubclass(nanguard.StopRequested, RuntimeError)


@pytest.mark.parametrize("args, kwargs, error, fragment", [
    (("model",), {}, TypeError, "torch.nn.Module"),
    ((nn.Linear(2, 2), "sgd"), {}, TypeError, "optimizer"),
    ((nn.Linear(2, 2),), {"on_stop": 3}, TypeError, "on_stop"),
    ((nn.ReLU(),), {}, nanguard.NanguardError, "no parameters"),
    ((nn.Linear(2, 2),), {"on_nan": "panic"}, nanguard.ConfigError, "on_nan"),
    ((nn.Linear(2, 2),), {"bogus": 1}, nanguard.ConfigError, "unknown nanguard setting"),
])
def test_bad_arguments_get_clear_errors(args, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        nanguard.init(*args, **kwargs)


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_init_twice_is_an_error_and_never_doubles_hooks():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.init(model, optimizer)
    hooks = hook_count(model)
    with pytest.raises(nanguard.NanguardError, match="already guarded"):
        nanguard.init(model, optimizer)
    with pytest.raises(nanguard.NanguardError, match="already guarded"):
        nanguard.init(model[2])  # a part of a guarded model
    assert hook_count(model) == hooks
    guard.close()
    again = nanguard.init(model, optimizer)
    assert hook_count(model) == hooks
    again.close()


def test_close_removes_every_hook_and_check_after_close_fails():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert hook_count(model) == 0 and not optimizer._optimizer_step_pre_hooks
    with nanguard.init(model, optimizer) as guard:
        assert hook_count(model) > 0 and optimizer._optimizer_step_pre_hooks
    assert hook_count(model) == 0 and not optimizer._optimizer_step_pre_hooks
    guard.close()  # idempotent
    with pytest.raises(nanguard.GuardClosedError, match="closed"):
        guard.check(torch.ones(1))
    model[2].armed = True
    train_step(model, optimizer)  # nothing left to raise
    assert "closed" in repr(guard)


def test_check_rejects_non_tensors(mlp):
    _, _, guard = mlp
    with pytest.raises(TypeError, match="torch.Tensor"):
        guard.check(1.0)
    with pytest.raises(TypeError, match="name"):
        guard.check(torch.ones(1), name="")


def test_disable_installs_nothing(monkeypatch):
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.init(model, optimizer)
    assert hook_count(model) == 0 and not optimizer._optimizer_step_pre_hooks
    model[2].armed = True
    train_step(model, optimizer, guard)
    guard.close()


def test_bare_init_guards_every_model_and_optimizer_created_later():
    guard = nanguard.init()
    try:
        model = make_mlp()
        optimizer = torch.optim.Adam(model.parameters())
        train_step(model, optimizer, guard)
        train_step(model, optimizer, guard)
        assert guard.step == 2
        with pytest.raises(nanguard.NanguardError, match="process-wide"):
            nanguard.init()
        model[2].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
        assert (info.value.event.layer, info.value.event.step) == ("2", 2)
    finally:
        guard.close()
    assert not nn.modules.module._global_forward_pre_hooks
    model[2].armed = True
    train_step(model, optimizer)
    with nanguard.init() as again:
        assert not again.closed


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every way a tensor's value can reach Python. On the CPU there is no device to
    sync with, so this stands in for torch.cuda.set_sync_debug_mode (a mock at the GPU edge)."""
    counter = {"n": 0}
    package = os.path.dirname(nanguard.__file__) + os.sep

    def from_nanguard() -> bool:  # optimizers read their own step counters: not ours to count
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(package):
                return True
            frame = frame.f_back
        return False

    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, __original=original, **k):
            counter["n"] += from_nanguard()
            return __original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counter


@pytest.mark.parametrize("settings", [{}, {"param_grad_norms": True}])
def test_exactly_one_host_read_per_clean_step(host_reads, settings):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.1),
                          nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    xs = [torch.randn(5, 8) for _ in range(10)]
    ys = [torch.randint(0, 4, (5,)) for _ in range(10)]
    with nanguard.init(model, optimizer, **settings) as guard:
        host_reads["n"] = 0
        for x, y in zip(xs, ys):
            for micro in range(2):  # gradient accumulation: still one read per optimizer step
                loss = nn.functional.cross_entropy(model(x), y)
                guard.check(loss)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert host_reads["n"] == 10


def test_one_host_read_with_batchnorm_a_gradscaler_and_the_flight_recorder(host_reads):
    # buffers kept and checked, the scaler's scale recorded, gradients taken as produced:
    # all of it rides on the one read
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with nanguard.init(model, optimizer, scaler=scaler) as guard:
        host_reads["n"] = 0
        for _ in range(6):
            loss = nn.functional.cross_entropy(model(torch.randn(5, 8)), torch.randint(0, 4, (5,)))
            guard.check(loss)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        reads = host_reads["n"]
    assert guard.step == 6
    # nanguard reads once a step (the scaler's own reads of its found-inf flag are not counted)
    assert reads == 6, reads


def test_a_bad_step_reads_more_only_once_it_is_bad(host_reads):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        host_reads["n"] = 0
        model[2].armed = True
        with pytest.raises(nanguard.NonFiniteError):
            train_step(model, optimizer, guard)
        assert host_reads["n"] > 1


def test_compiled_model_keeps_one_graph_and_still_stops():
    torch._dynamo.reset()
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        explained = torch._dynamo.explain(model)(torch.randn(5, 8))
        assert explained.graph_break_count == 0
        compiled = torch.compile(model, backend="aot_eager")
        train_step(compiled, optimizer, guard)
        model[2].armed = True
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager")
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(compiled, optimizer, guard)
    # inside a compiled graph only leaf outputs are checked: the Fault container's own NaN is
    # first seen in the next leaf that computes on it
    event = info.value.event
    assert (event.layer, event.input_nonfinite, event.has_nan) == ("4", None, True)
    assert "compiled graph" in event.message


def test_bare_init_with_a_compiled_model():
    """Compiled code runs FX graphs as modules: a bare init() must leave those alone."""
    torch._dynamo.reset()
    with nanguard.init() as guard:
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        compiled = torch.compile(model, backend="aot_eager")
        train_step(compiled, optimizer, guard)
        model[4].weight.data[0, 0] = math.nan
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(compiled, optimizer, guard)
    assert (info.value.event.layer, info.value.event.step) == ("4", 1)


def test_replay_of_a_folder_without_manifest_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("NANGUARD_REPLAY", str(tmp_path))
    with pytest.raises(nanguard.NanguardError, match="incomplete: no manifest.json"):
        nanguard.init(make_mlp())


def test_replay_and_disable_together_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("NANGUARD_REPLAY", str(tmp_path))
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    with pytest.raises(nanguard.ConfigError, match="NANGUARD_REPLAY and NANGUARD_DISABLE"):
        nanguard.init(make_mlp())


def test_cli_inspect_reads_a_captured_incident(tmp_path, capsys):
    import json

    from nanguard.cli import main

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, dir=str(tmp_path)) as guard:
        model[2].armed = True
        with pytest.raises(nanguard.NonFiniteError) as info:
            train_step(model, optimizer, guard)
    capsys.readouterr()
    assert main(["inspect", info.value.incident, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 0 and report["first_event"]["layer"] == "2"
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


def test_a_run_id_too_long_for_the_wire_never_fails_init(monkeypatch):
    from nanguard.protocol import MAX_JOB_LENGTH, job_name

    long_a, long_b = "a" * 300, "a" * 299 + "b"
    assert len(job_name(long_a)) <= MAX_JOB_LENGTH and job_name(long_a) != job_name(long_b)
    assert job_name("run-7") == "run-7" and job_name(None) == "local"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", long_a)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # nothing listens there: the link retries in the background, training is not held up
    with nanguard.init(model, optimizer, coordinator="tcp://127.0.0.1:9", heartbeat_s=0.05) as guard:
        train_step(model, optimizer, guard)
        assert guard.step == 1
