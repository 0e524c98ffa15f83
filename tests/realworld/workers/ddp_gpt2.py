"""transformers' GPT-2 in DistributedDataParallel (gloo, CPU) under nanguard.init(model, optimizer),
with a fault on one rank at one step: a +inf weight (forward) or a NaN born in the backward.

Writes OUT_DIR/rank{RANK}.json: what nanguard raised, the state digests before and after the
refused step, and what the oracles (our own hooks on the inner model) saw on this rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1] / "integration" / "workers")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import nanguard  # noqa: E402
from common import digest, write_json  # noqa: E402
from oracles import ForwardOracle, GradOracle  # noqa: E402
from zoo import gpt2, poison_backward_of, token_batch  # noqa: E402


def run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    net = gpt2()
    poison = poison_backward_of(net.transformer.h[0].mlp.c_proj)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = nanguard.init(model, optimizer)
    oracle, grads = ForwardOracle(net), GradOracle(net)
    result = {"rank": rank, "steps_done": 0, "error": None, "exception": None}
    before = {}
    try:
        for step in range(args.steps):
            hit = rank == args.fault_rank and step == args.fault_step
            if hit and args.fault == "forward":
                with torch.no_grad():
                    net.transformer.h[1].mlp.c_fc.weight[3, 5] = math.inf
            poison.fill_(math.nan if hit and args.fault == "backward" else 1.0)
            oracle.reset()
            grads.order.clear()
            before = {"weights": digest(net.state_dict()), "optim": digest(optimizer.state_dict())}
            ids = token_batch(100 * rank + step)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            result["steps_done"] += 1
    except nanguard.NonFiniteError as err:
        producer = oracle.producer()
        result["error"] = {
            "event": err.event.to_dict(), "incident": err.incident, "guard_step": guard.step,
            "weights_before": before["weights"], "weights_after": digest(net.state_dict()),
            "optim_before": before["optim"], "optim_after": digest(optimizer.state_dict()),
            "oracle_producer": dataclasses.asdict(producer) if producer is not None else None,
            "oracle_first_bad_grads": sorted(grads.bad_params_of_first_module()),
        }
    finally:
        guard.close()
        oracle.close()
        grads.close()
    write_json(args.out_dir, rank, result)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--fault", choices=("forward", "backward"), required=True)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    try:
        run(args)  # the model is freed when run() returns
    except BaseException:
        write_json(args.out_dir, rank, {"rank": rank, "exception": traceback.format_exc()})
        raise
    safe = nanguard.destroy_process_group()
    path = os.path.join(args.out_dir, f"rank{rank}.json")
    import json

    with open(path) as f:
        write_json(args.out_dir, rank, {**json.load(f), "exit_safe": safe})
    return 0


if __name__ == "__main__":
    sys.exit(main())
