"""GPT-2 in DDP on 2 ranks (torchrun, gloo on CPU): a fault on rank 1 stops both ranks at the same
step, before the update, with one event that names rank 1 and what the oracles saw there."""

from __future__ import annotations

import pytest

from helpers import WORKERS, needs

pytestmark = pytest.mark.slow
WORLD, BAD_RANK, BAD_STEP = 2, 1, 2


def ddp_stop(torchrun, fault: str) -> tuple[dict, dict]:
    """Both ranks raised at BAD_STEP with the same event, their state untouched: (event, results)."""
    needs("transformers")
    job = torchrun.standalone(WORKERS / "ddp_gpt2.py", "--fault", fault, "--fault-rank", str(BAD_RANK),
                              "--fault-step", str(BAD_STEP), timeout=240)
    results = job.ok(world=WORLD)
    errors = {rank: r["error"] for rank, r in results.items()}
    for rank, error in errors.items():
        assert error is not None, f"rank {rank} did not stop ({results[rank]['steps_done']} steps)"
        assert results[rank]["steps_done"] == BAD_STEP
        assert error["guard_step"] == BAD_STEP + 1
        assert error["weights_after"] == error["weights_before"], f"rank {rank}: weights changed"
        assert error["optim_after"] == error["optim_before"], f"rank {rank}: optimizer state changed"
    events = [e["event"] for e in errors.values()]
    assert all(e == events[0] for e in events), events  # one event, the same on every rank
    assert len({e["incident"] for e in errors.values()}) == 1
    return events[0], errors


@pytest.mark.timeout(300)
def test_ddp_gpt2_forward_fault_on_rank_1(torchrun):
    event, errors = ddp_stop(torchrun, "forward")
    truth = errors[BAD_RANK]["oracle_producer"]
    assert (truth["name"], truth["inputs_finite"]) == ("transformer.h.1.mlp.c_fc", True)
    assert errors[0]["oracle_producer"] is None  # rank 0's own forward was clean
    assert (event["step"], event["rank"], event["kind"]) == (BAD_STEP, BAD_RANK, "forward")
    assert (event["layer"], event["module_type"]) == (truth["name"], "Conv1D")  # no DDP "module." prefix
    assert (event["input_nonfinite"], event["output_nonfinite"]) == (False, True)


@pytest.mark.timeout(300)
def test_ddp_gpt2_backward_nan_on_rank_1_is_named_on_rank_1(torchrun):
    event, errors = ddp_stop(torchrun, "backward")
    first = errors[BAD_RANK]["oracle_first_bad_grads"]
    assert first == ["transformer.h.0.mlp.c_proj.bias", "transformer.h.0.mlp.c_proj.weight"]
    assert errors[0]["oracle_first_bad_grads"] == []  # rank 0's own gradients were finite (before the all-reduce)
    assert (event["step"], event["rank"], event["kind"]) == (BAD_STEP, BAD_RANK, "grad")
    assert event["layer"] in first, event["message"]
