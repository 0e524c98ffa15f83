"""DDP (gloo) training with a configurable fault; see common.py for the options."""

import sys

import common
from torch.nn.parallel import DistributedDataParallel


def wrap(net):
    model = DistributedDataParallel(net)
    return model, model.no_sync


if __name__ == "__main__":
    sys.exit(common.main(wrap))
