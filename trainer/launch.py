"""When this launch began: one time for every rank under torchrun, so Hydra's output folder
(`${launch_time:%H-%M-%S}`) is one folder for all of them, where `${now:}` would differ."""

from __future__ import annotations

import os
from datetime import datetime

LAUNCH_TIME_ENV = "FEEDBENCH_LAUNCH_TIME"  # rank 0's launch time, set by `trainer.loop.distributed.launch`


def launch_time(pattern: str) -> str:
    """`${launch_time:%H-%M-%S}`: rank 0's start under torchrun, else now."""
    stamp = os.environ.get(LAUNCH_TIME_ENV)
    return (datetime.fromisoformat(stamp) if stamp else datetime.now()).strftime(pattern)
