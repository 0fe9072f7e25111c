"""Device discovery: what accelerators this node has.

NVIDIA GPUs are found through NVML (``pynvml``, from the ``nvidia-ml-py``
distribution) without initialising CUDA; where NVML is missing, ``torch.cuda``
is asked, but only where a GPU driver's device file exists (importing torch
takes seconds, and the agents and launchers that ask are otherwise torch-free);
otherwise the node is a CPU node. A CPU node counts as one device of
type ``cpu``: several trainer processes on it stand for several GPUs, and a
server may be *emulated* (see :class:`jabascli.config.models.EmulationConfig`).
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""What an NVIDIA, an AMD (ROCm) or a WSL GPU driver creates; where none exists ``torch.cuda`` finds no device."""


@dataclass(frozen=True)
class NodeDevices:
    """The devices of one node, as a cluster-info entry would describe them."""

    backend: Literal["cuda", "cpu"]
    device_type: str
    count: int
    memory_bytes: int
    source: str  # which probe found them: "nvml", "torch.cuda" or "cpu"

    def server_entry(self, name: str | None = None, host: str = "127.0.0.1") -> dict[str, Any]:
        """A ``[[cluster.servers]]`` table for this node."""
        return {
            "name": name or socket.gethostname().split(".")[0] or "node0",
            "host": host,
            "device_type": self.device_type,
            "devices": self.count,
            "memory_bytes": self.memory_bytes,
        }


def detect_devices() -> NodeDevices:
    """The devices of this node: NVML, then torch.cuda, then the CPU."""
    return _detect_nvml() or _detect_torch_cuda() or _detect_cpu()


def _detect_nvml() -> NodeDevices | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    if isinstance(name, bytes):
        name = name.decode()
    return NodeDevices("cuda", str(name), int(count), int(memory), "nvml")


def _detect_torch_cuda() -> NodeDevices | None:
    if "torch" not in sys.modules and not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    props = torch.cuda.get_device_properties(0)
    return NodeDevices("cuda", props.name, torch.cuda.device_count(), int(props.total_memory), "torch.cuda")


def _detect_cpu() -> NodeDevices:
    return NodeDevices("cpu", "cpu", 1, _total_ram(), "cpu")


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _total_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def trainer_threads(trainers_here: int, environ: Mapping[str, str] | None = None) -> int:
    """torch threads of each trainer process ``jabas run`` starts on this machine.

    ``OMP_NUM_THREADS`` (of ``environ``, else this process's environment) when set;
    otherwise the machine's cores shared equally among the trainers that run on
    it, at least one each. The computation profiler measures a CPU or emulated
    device with the same count, so that a profile describes the trainer that will run.
    """
    configured = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, (os.cpu_count() or 1) // max(1, trainers_here))
