"""`python -m trainer` with NCCL's shutdown on any backend: `destroy_process_group` returns only
once every rank has called it (`ncclCommAbort` is a collective call in some NCCL versions), and a
rank that waits there 30 s exits with status 3. Run it under torchrun in place of `-m trainer`."""

import os
import runpy
import sys
import time

import torch.distributed as dist

_destroy = dist.destroy_process_group


def _together(group=None):
    store = dist.distributed_c10d._get_default_store()
    store.add("test/leaving", 1)
    deadline = time.monotonic() + 30
    while store.add("test/leaving", 0) < dist.get_world_size():
        if time.monotonic() > deadline:
            print("destroy_process_group waited 30 s for the other ranks", file=sys.__stderr__, flush=True)
            os._exit(3)
        time.sleep(0.05)
    _destroy(group)


dist.destroy_process_group = _together
sys.argv[0] = "trainer"
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
