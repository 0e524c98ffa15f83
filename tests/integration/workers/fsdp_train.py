"""FSDP2 (fully_shard, gloo on CPU) training with a configurable fault; see common.py."""

import contextlib
import sys

import common
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter


OWN = "--own-reduce-scatter" in sys.argv
ONE_UNIT = "--blocks-one-unit" in sys.argv  # both blocks (two Linears) in one fully_shard unit


class OwnReduceScatter(DefaultReduceScatter):
    """A team's own reduce-scatter (``--own-reduce-scatter``), which nanguard leaves alone."""


def wrap(net):
    for block in [net.blocks] if ONE_UNIT else net.blocks:
        fully_shard(block)
    fully_shard(net)
    if OWN:
        for module in ([net.blocks] if ONE_UNIT else [*net.blocks]) + [net]:
            module.set_custom_reduce_scatter(OwnReduceScatter())
    return net, contextlib.nullcontext


if __name__ == "__main__":
    for flag in ("--own-reduce-scatter", "--blocks-one-unit"):  # (not common.parser()'s)
        if flag in sys.argv:
            sys.argv.remove(flag)
    sys.exit(common.main(wrap))
