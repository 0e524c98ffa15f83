"""The public surface, bad use, installing and removing hooks, the one-read-per-step budget."""

import math
import os
import sys
import weakref

import pytest
import torch
from torch import nn

import nanguard
from nanguard.rank import places
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
    ((nn.Linear(2, 2), []), {}, TypeError, "got an empty list"),
    ((nn.Linear(2, 2), (torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), "adam")), {}, TypeError,
     "got a tuple whose item 1 is str"),
    ((nn.Linear(2, 2),), {"on_stop": 3}, TypeError, "on_stop"),
    ((nn.ReLU(),), {}, nanguard.NanguardError, "no parameters"),
    ((nn.Linear(2, 2),), {"on_nan": "panic"}, nanguard.ConfigError, "on_nan"),
    ((nn.Linear(2, 2),), {"bogus": 1}, nanguard.ConfigError, "unknown nanguard setting"),
])
def test_bad_arguments_get_clear_errors(args, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        nanguard.init(*args, **kwargs)


def test_an_optimizer_of_another_model_is_said_at_init(caplog):
    model, elsewhere = nn.Linear(2, 2), nn.Linear(2, 2)
    with nanguard.init(model, torch.optim.SGD(model.parameters(), lr=1)):
        pass
    assert "steps none of the parameters" not in caplog.text
    with nanguard.init(model, torch.optim.SGD(elsewhere.parameters(), lr=1)):
        pass
    assert "the optimizer SGD steps none of the parameters of the model given (Linear)" in caplog.text


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


def process_hooks() -> int:
    """The process-wide hooks nanguard installs: optimizer step pre-hooks, registration hooks."""
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(optimizer._global_optimizer_pre_hooks) + len(module._global_module_registration_hooks)
            + len(module._global_parameter_registration_hooks))


def test_a_guard_never_closed_goes_with_its_model_and_optimizer_and_its_process_hooks_too():
    # a sweep's trials, or a notebook cell run again, that never call close(): each guard went on
    # holding a process-wide optimizer hook that every later optimizer step ran (300 such: 33 to
    # 300 us per step of an optimizer no guard knows), and its memory
    import gc

    def trial():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = nanguard.init(model, optimizer)
        train_step(model, optimizer)
        return weakref.ref(guard)

    gc.collect()
    before = process_hooks()
    guards = [trial() for _ in range(20)]
    gc.collect()
    assert sum(ref() is not None for ref in guards) <= 1  # (the last may wait for the next collection)
    other = make_mlp()
    with nanguard.init(other, torch.optim.SGD(other.parameters(), lr=0.1)):  # lets go of the gone ones' hooks
        assert process_hooks() <= before + 2 * 3
    gc.collect()
    assert all(ref() is None for ref in guards)


def test_a_guard_never_closed_closes_its_coordinator_link_at_the_next_init(monkeypatch):
    # each unclosed trial of a sweep run with a coordinator kept its link (a socket and a sender
    # thread) until the process exited
    import gc
    import socket
    import threading

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    before = set(threading.enumerate())
    monkeypatch.setenv("NANGUARD_COORDINATOR", f"tcp://127.0.0.1:{port}")  # (nobody there: links wait)

    def trial():
        model = make_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        nanguard.init(model, optimizer)
        train_step(model, optimizer)

    for _ in range(4):
        trial()
    links = [thread for thread in threading.enumerate() if thread not in before]
    assert len(links) == 4  # (the links' sender threads)
    monkeypatch.delenv("NANGUARD_COORDINATOR")
    gc.collect()
    gc.collect()  # (what the first collection freed lets the last guards go)
    other = make_mlp()
    with nanguard.init(other, torch.optim.SGD(other.parameters(), lr=0.1)):  # lets go of the gone ones
        for thread in links:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in links)


def test_a_guard_nobody_keeps_guards_as_long_as_its_model_and_optimizer_live():
    import gc

    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = weakref.ref(nanguard.init(model, optimizer))  # the one line of a script that keeps nothing
    gc.collect()
    train_step(model, optimizer)
    model[2].armed = True
    with pytest.raises(nanguard.NonFiniteError):
        train_step(model, optimizer)
    assert guard() is not None
    guard().close()


def test_check_rejects_non_tensors(mlp):
    _, _, guard = mlp
    with pytest.raises(TypeError, match="torch.Tensor"):
        guard.check(1.0)
    with pytest.raises(TypeError, match="name"):
        guard.check(torch.ones(1), name="")


def test_disable_installs_nothing_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("NANGUARD_DISABLE", "1")
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.init(model, optimizer)
    assert hook_count(model) == 0 and not optimizer._optimizer_step_pre_hooks
    # a variable left in a job's environment must not turn the guard off without a trace
    assert any("nanguard: disabled (NANGUARD_DISABLE=1" in r.getMessage() for r in caplog.records)
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
    sync with, so this stands in for torch.cuda.set_sync_debug_mode (a mock at the GPU edge).
    The probes are taken to sit on a device: nothing is free to read at a forward's end
    (``Slots.read_if_free`` reads only CPU memory: test_detail_of_a_clean_forward_* below)."""
    counter = {"n": 0}
    monkeypatch.setattr(places.Slots, "read_if_free", lambda self, values: None)
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


def _accumulate(model, optimizer, guard, micro_batches, on_forward=lambda k: None):
    """One optimizer step of ``micro_batches`` forwards and backwards, 64 samples each."""
    for k in range(micro_batches):
        output = model(torch.randn(64, 8))
        on_forward(k)
        loss = nn.functional.cross_entropy(output, torch.randint(0, 4, (64,)))
        guard.check(loss)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.modes("full")  # (a forward's end in the full mode: the sentinel keeps no detail)
def test_detail_of_a_clean_forward_is_let_go_at_its_end_on_the_cpu():
    # Fault's output (64 x 2048, 512 KiB) is saved by no backward: plain training frees it as the
    # forward ends. Kept for detail until the step's decision, it would outlive the backward pass.
    model = make_mlp(width=2048)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    model[2].register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
    with nanguard.init(model, optimizer) as guard:
        gone = []
        _accumulate(model, optimizer, guard, 4, lambda k: gone.append(outputs[-1]() is None))
        assert gone == [True] * 4 and guard.step == 1
        model[2].armed = True  # a bad forward keeps what it probed: its report describes it exactly
        with pytest.raises(nanguard.NonFiniteError) as info:
            _accumulate(model, optimizer, guard, 1, lambda k: gone.append(outputs[-1]() is None))
    assert gone[-1] is False
    assert info.value.event.first_index == (0, 3) and info.value.event.bad_count == 1


class _MaskedAttention(nn.Module):
    """Scores plus an additive -inf mask made in its own code, into a softmax: inputs non-finite
    on purpose, every output finite."""

    def __init__(self, width: int = 1024):
        super().__init__()
        self.scores, self.softmax, self.head = nn.Linear(8, width), nn.Softmax(-1), nn.Linear(width, 4)

    def forward(self, x):
        mask = torch.zeros(x.shape[0], self.head.in_features)
        mask[:, 0] = -math.inf
        return self.head(self.softmax(self.scores(x) + mask))


def test_detail_is_let_go_beside_an_additive_mask():
    model = _MaskedAttention()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scores = []
    model.scores.register_forward_hook(lambda module, args, output: scores.append(weakref.ref(output)))
    with nanguard.init(model, optimizer) as guard:
        gone = []
        _accumulate(model, optimizer, guard, 2, lambda k: gone.append(scores[-1]() is None))
        assert gone == [True, True] and guard.step == 1 and not guard.events


@pytest.mark.modes("full")  # (a forward's end in the full mode: the sentinel keeps no detail)
def test_little_kept_detail_is_not_worth_a_read_at_the_forward_end(monkeypatch):
    # 64 x 16 activations: reading the probes at each forward's end would cost more than
    # giving back a few KiB saves; they are kept to the decision, as on a device
    reads = []
    free_read = places.Slots.read_if_free
    monkeypatch.setattr(places.Slots, "read_if_free", lambda self, values: reads.append(1) or free_read(self, values))
    for width, read in ((16, []), (2048, [1] * 4)):  # 64 x 2048 floats: 512 KiB, worth it
        model = make_mlp(width)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with nanguard.init(model, optimizer) as guard:
            _accumulate(model, optimizer, guard, 4)
            assert guard.step == 1 and reads == read
        reads.clear()


def test_detail_of_a_clean_forward_is_spent_again_on_the_next_micro_batch():
    # a budget for one micro-batch's tensors (three of 64 KiB), not four: a value gone bad in the
    # last micro-batch is described exactly, its index and value, not from its extremes alone
    model = make_mlp(width=256)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer, detail_mb=0.25) as guard:
        with pytest.raises(nanguard.NonFiniteError) as info:
            # armed after the third forward: the fourth, the last, goes bad
            _accumulate(model, optimizer, guard, 4, lambda k: setattr(model[2], "armed", k == 2))
    event = info.value.event
    assert (event.layer, event.micro_batch) == ("2", 3)
    assert event.first_index == (0, 3) and math.isnan(event.first_value) and event.bad_count == 1


def test_only_values_in_cpu_memory_are_free_to_read():
    # on a device, reading the probes at a forward's end would sync: only the step's one read does
    for device, free in (("cpu", [1.0, 2.0]), ("meta", None)):
        slots = places.Slots()
        like = torch.empty(3, device=device)
        low, high = slots.take(like)
        if free:
            low.fill_(1.0)
            high.fill_(2.0)
        assert slots.read_if_free([low, high]) == free
        assert slots.read_if_free([low, high, low, high]) is None  # two written elsewhere (compiled)


@pytest.mark.modes("sentinel", "full")
def test_compiled_model_keeps_one_graph_and_still_stops(guard_mode):
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
    event = info.value.event
    if guard_mode == "full":
        # inside a compiled graph only leaf outputs are checked: the Fault container's own NaN is
        # first seen in the next leaf that computes on it
        assert (event.layer, event.input_nonfinite, event.has_nan) == ("4", None, True)
        assert "compiled graph" in event.message
    else:  # the microscope re-runs the bad step eagerly: every module's output is probed, the Fault's too
        assert (event.layer, event.input_nonfinite, event.reproduced) == ("2", False, True)


def test_a_model_compiled_in_place_keeps_its_batch_and_buffers_and_compiles_once(incidents_in_tmp):
    # module.compile() runs the root's hooks inside the compiled frame: the batch must still be
    # captured and the buffers kept, and the micro-batch count must not recompile the graph
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer) as guard:
        model.compile(backend="aot_eager")
        for step in range(3):
            for micro in range(2):
                x = torch.randn(16, 4)
                if (step, micro) == (2, 1):
                    x[3, 1] = math.nan
                model(x).sum().backward()
            if step == 2:
                assert not torch.isfinite(model[1].running_mean).all()
                with pytest.raises(nanguard.NonFiniteError):
                    optimizer.step()
                # the stopped step's statistics (NaN) were put back as they were before it
                assert torch.isfinite(model[1].running_mean).all()
            else:
                optimizer.step()
            optimizer.zero_grad()
        counters = dict(torch._dynamo.utils.counters["stats"])
    torch._dynamo.reset()
    (event,) = guard.events
    assert (event.step, event.micro_batch, event.input_nonfinite) == (2, 1, True), event
    assert event.message.startswith("the input batch of the model was already non-finite"), event.message
    batches = nanguard.incident.read_incident(guard.incident).rank_batches(0, [])
    assert len(batches) == 2 and torch.isnan(batches[1]["args"][0][3, 1])
    # the frame, split once by the root's bookkeeping (2 here), not compiled again per micro-batch
    assert 1 <= counters.get("unique_graphs", 0) <= 3, counters


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
