"""Every change nanguard makes to what torch does is listed in ``nanguard._torch.patches.PATCHES``; each is
applied here through a guard (or the function that makes it) and undone, and torch is then as it was:
the same callables in the same places, the same hooks in the same order, the same reduce-scatter.

One test per entry of ``PATCHES``, registered by its name: a change added there without a test here fails."""

from __future__ import annotations

import functools

import torch
import torch.nn.modules.module as module_hooks
from torch import nn

import nanguard
from nanguard._torch import patches

CHECKED = set()


def check(name: str):
    """Register the test that checks ``PATCHES[name]``."""
    CHECKED.add(name)
    return lambda test: test


def _hook_tables(model: nn.Module) -> dict:
    """Every hook table torch keeps for ``model`` and process-wide, as (key, hook) in order."""
    tables = {name: list(getattr(module_hooks, name).items()) for name in patches._GLOBAL_HOOKS}
    tables.update({(i, name): list(getattr(m, name).items())
                   for i, m in enumerate(model.modules()) for name in patches._MODULE_HOOKS})
    return tables


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@check("optimizer.step(closure)")
def test_a_closure_is_wrapped_for_its_call_only():
    calls = []
    optimizer = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    closure = lambda: 1.0  # noqa: E731
    args, kwargs = patches.wrap_closure((optimizer, closure), {}, lambda first, loss: calls.append(first) or loss)
    assert args[1] is not closure and args[1]() == 1.0 and args[1]() == 1.0 and calls == [True, False]
    assert patches.wrap_closure((optimizer,), {}, lambda first, loss: loss) is None  # no closure: nothing wrapped
    assert closure() == 1.0 and calls == [True, False] and "step" not in optimizer.__dict__  # nothing stays


@check("GradScaler.update")
def test_the_scaler_update_is_put_back_at_close():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    before = scaler.update
    with nanguard.init(model, optimizer, scaler=scaler):
        assert "update" in scaler.__dict__  # the guard decides a step the scaler skips
    assert "update" not in scaler.__dict__ and scaler.update == before


@check("torch.nn.utils.stateless._reparametrize_module")
def test_functional_calls_reparametrize_is_put_back_at_close():
    from torch.nn.utils import stateless

    before = stateless._reparametrize_module
    model = _mlp()
    with nanguard.init(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        assert stateless._reparametrize_module is patches._handing  # (before: torch's, or ours where a guard of an earlier test lives on)
        weights = {name: p.detach() * 2 for name, p in model.named_parameters()}
        torch.func.functional_call(model, weights, (torch.randn(3, 4),))
    assert stateless._reparametrize_module is before


@check("DistributedDataParallel.register_comm_hook, before the first forward")
def test_a_new_ddps_register_comm_hook_is_put_back_at_close(gloo):
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.init(model, optimizer):
        ddp = nn.parallel.DistributedDataParallel(model)
        assert "register_comm_hook" in ddp.__dict__  # a hook registered now would route through ours
    assert "register_comm_hook" not in ddp.__dict__
    assert ddp.register_comm_hook.__func__ is nn.parallel.DistributedDataParallel.register_comm_hook


@check("DistributedDataParallel's communication hook")
def test_ddps_hook_after_close_sums_as_the_default_and_routes_the_scripts(gloo):
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    with nanguard.init(ddp, optimizer) as guard:
        ddp(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert guard._detector.backward.watches_buckets
    # DDP takes one hook for its life: after close ours only sums (a world of one: the gradient as it was)
    ddp(x).sum().backward()
    plain = _mlp()
    plain.load_state_dict(ddp.module.state_dict())
    plain(x).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ddp.parameters(), plain.parameters(), strict=True))
    seen = []
    ddp.register_comm_hook("mine", lambda state, bucket: seen.append(state) or _done(bucket))
    ddp(x).sum().backward()
    assert seen == ["mine"]  # the script's own hook, registered after close, is the one that sums


def _done(bucket):
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@check("FSDP2's reduce-scatter")
def test_fsdp2s_reduce_scatters_are_put_back_at_close(gloo):
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    fully_shard(model[0])
    fully_shard(model)
    comms = lambda: [g._reduce_scatter_comm for m in (model, model[0])  # noqa: E731
                     for g in m._get_fsdp_state()._fsdp_param_groups]
    before = comms()
    with nanguard.init(model, torch.optim.SGD(model.parameters(), lr=0.1)) as guard:
        assert guard._detector.backward.watches_buckets
        assert all(type(c).__name__ == "Watched" for c in comms())
    assert comms() == before


@check("torch's hook tables")
def test_hooks_set_aside_come_back_in_their_order():
    model = _mlp()
    mine = model[0].register_forward_hook(lambda *a: None)
    with nanguard.init(model, torch.optim.SGD(model.parameters(), lr=0.1)):
        before = _hook_tables(model)
        with patches.hooks_set_aside(model):
            inside = _hook_tables(model)
            late = model[2].register_forward_pre_hook(functools.partial(lambda *a: None))
        assert all(not patches._ours(hook) for table in inside.values() for _, hook in table)
        assert any(patches._ours(hook) for table in before.values() for _, hook in table)
        after = _hook_tables(model)
        late_key = (3, "_forward_pre_hooks")  # (model.modules(): the Sequential first)
        assert after[late_key][-1][0] == late.id  # registered meanwhile: kept, behind ours
        late.remove()
        assert _hook_tables(model) == before
    mine.remove()


@check("torch.distributed.nn.functional's default arguments")
def test_destroyed_groups_leave_the_default_arguments(tmp_path):
    import torch.distributed as dist
    import torch.distributed.nn.functional as functional

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert patches.release_destroyed_groups() == []  # a group in use: nothing touched
    finally:
        dist.destroy_process_group()
    released = patches.release_destroyed_groups()
    assert all(isinstance(g, dist.ProcessGroup) for g in released)
    assert not any(isinstance(v, dist.ProcessGroup) for f in vars(functional).values()
                   for v in (getattr(f, "__defaults__", None) or ()))


def test_every_patch_has_a_check():
    assert CHECKED == set(patches.PATCHES)
