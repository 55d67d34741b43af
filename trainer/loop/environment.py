"""Where a result was measured: versions, GPU, driver, PCIe link, CPU, git commit."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
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


def parse_topology(text: str) -> Dict[str, Dict[str, str]]:
    """`nvidia-smi topo -m`'s matrix: {"GPU0": {"GPU1": "NV18", "NUMA Affinity": "0", ...}, ...}
    (a link: X itself, NV<n> n NVLinks, PIX/PXB one or more PCIe switches, PHB a host bridge,
    NODE within a NUMA node, SYS across NUMA nodes)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in text.splitlines()]
    if not lines:
        return {}
    columns = [c.strip() for c in lines[0].split("\t") if c.strip()]
    rows: Dict[str, Dict[str, str]] = {}
    for line in lines[1:]:
        if not line.strip():
            break  # the legend follows the matrix
        cells = [c.strip() for c in line.split("\t") if c.strip()]  # (nvidia-smi pads with empty cells)
        if cells[0].startswith("GPU"):
            rows[cells[0]] = dict(zip(columns, cells[1:]))
    return rows


@functools.lru_cache(maxsize=1)
def gpu_topology() -> Dict[str, Dict[str, str]]:
    """This host's GPU topology (`parse_topology`), read once per process; {} without nvidia-smi."""
    text = _cmd(["nvidia-smi", "topo", "-m"])
    return parse_topology(text) if text else {}


def gpu_numa_node(device: torch.device) -> str:
    """The NUMA node the GPU hangs off (its PCI device's, as the kernel reports it), or "?"."""
    if device.type != "cuda":
        return "?"
    props = torch.cuda.get_device_properties(device)
    bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
    try:
        return open(f"/sys/bus/pci/devices/{bus}/numa_node").read().strip()
    except OSError:
        return "?"


def gpu_links(indices) -> str:
    """The links between the GPUs `indices` (CUDA's numbering, as nvidia-smi's when nothing
    reorders them), e.g. "NV18"; several kinds listed in pair order; "" for fewer than two GPUs."""
    topo, found = gpu_topology(), []
    for i, a in enumerate(indices):
        for b in indices[i + 1:]:
            link = topo.get(f"GPU{a}", {}).get(f"GPU{b}")
            if link and link not in found:
                found.append(link)
    return ",".join(found)


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
        **({"gpu_numa_node": gpu_numa_node(device), "gpu_topology": gpu_topology()} if device.type == "cuda" else {}),
    }
