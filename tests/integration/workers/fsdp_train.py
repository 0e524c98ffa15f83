"""FSDP2 (fully_shard, gloo on CPU) training with a configurable fault; see common.py."""

import contextlib
import sys

import common
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter


OWN = "--own-reduce-scatter" in sys.argv


class OwnReduceScatter(DefaultReduceScatter):
    """A team's own reduce-scatter (``--own-reduce-scatter``), which nanguard leaves alone."""


def wrap(net):
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    if OWN:
        for module in (*net.blocks, net):
            module.set_custom_reduce_scatter(OwnReduceScatter())
    return net, contextlib.nullcontext


if __name__ == "__main__":
    if OWN:
        sys.argv.remove("--own-reduce-scatter")  # (not one of common.parser()'s)
    sys.exit(common.main(wrap))
