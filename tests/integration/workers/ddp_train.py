"""DDP (gloo) training with a configurable fault; see common.py for the options."""

import contextlib
import sys

import common
from torch.nn.parallel import DistributedDataParallel


def wrap(net):
    if "--hand-sum" in sys.argv:  # the script sums the gradients itself
        return net, contextlib.nullcontext
    model = DistributedDataParallel(net)
    if "--fp16-hook" in sys.argv:  # registered after nanguard's own would be too (it is called by it)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        model.register_comm_hook(None, fp16_compress_hook)
    # --sync-every-micro: accumulation without no_sync, every micro-batch's backward all-reduces
    return model, contextlib.nullcontext if "--sync-every-micro" in sys.argv else model.no_sync


if __name__ == "__main__":
    sys.exit(common.main(wrap))
