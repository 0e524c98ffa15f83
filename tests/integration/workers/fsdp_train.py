"""FSDP2 (fully_shard, gloo on CPU) training with a configurable fault; see common.py."""

import contextlib
import sys

import common
from torch.distributed.fsdp import fully_shard


def wrap(net):
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    return net, contextlib.nullcontext


if __name__ == "__main__":
    sys.exit(common.main(wrap))
