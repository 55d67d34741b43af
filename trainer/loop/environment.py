"""Where a result was measured: versions, GPU, driver, PCIe link, CPU, git commit."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Dict, Optional

import torch

from trainer.config import INSTALLED, PROJECT_ROOT


def _cmd(args) -> Optional[str]:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:  # e.g. feedbench run from a checkout never installed
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info(device: torch.device) -> Dict[str, object]:
    """Name, memory, driver and PCIe link of the GPU (empty on CPU)."""
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    info = {"gpu_name": props.name, "gpu_memory_gb": round(props.total_memory / 1e9, 1),
            "gpu_multiprocessors": props.multi_processor_count}
    q = "driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
    smi = _cmd(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader", "-i", str(device.index or 0)])
    if smi:
        keys = ["driver_version", "pcie_gen_current", "pcie_gen_max", "pcie_width_current", "pcie_width_max"]
        info.update(dict(zip(keys, (v.strip() for v in smi.split(",")))))
    return info


def describe(device: torch.device) -> Dict[str, object]:
    """Everything `environment.json` records."""
    import hydra
    import mlflow
    import numpy

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        # Its distribution's version, not `torchvision.__version__`: importing torchvision pulls in
        # torch._dynamo, about 2 s added to every run that does not read MNIST or CIFAR.
        "torchvision": _dist_version("torchvision"),
        "numpy": numpy.__version__,
        "mlflow": mlflow.__version__,
        "hydra": hydra.__version__,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "feedbench": _dist_version("feedbench"),
        # Installed from a wheel, the package sits in site-packages: any git repository around it is not ours.
        "git_commit": None if INSTALLED else _cmd(["git", "-C", str(PROJECT_ROOT), "rev-parse", "HEAD"]),
        **gpu_info(device),
    }
