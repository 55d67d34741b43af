"""A Hydra launcher for tests: each job is a fresh `python -m trainer <its overrides>` process.

It stands in for the launchers that run jobs elsewhere (worker pools, clusters): a job gets
nothing from the launching process but its overrides. Select it with
`hydra/launcher=subprocess` and this folder's parent on PYTHONPATH.
"""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher


@dataclass
class SubprocessLauncherConf:
    _target_: str = "hydra_plugins.subprocess_launcher.SubprocessLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="subprocess", node=SubprocessLauncherConf)


class SubprocessLauncher(Launcher):
    def setup(self, *, hydra_context, task_function, config) -> None:
        self.config = config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        returns: List[JobReturn] = []
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            proc = subprocess.run([sys.executable, "-m", "trainer", *overrides, f"hydra.run.dir={sweep_dir / str(idx)}"])
            ret = JobReturn(overrides=list(overrides))
            if proc.returncode == 0:
                ret.status, ret.return_value = JobStatus.COMPLETED, None
            else:
                ret.status, ret.return_value = JobStatus.FAILED, RuntimeError(f"job exited with {proc.returncode}")
            returns.append(ret)
        return returns
