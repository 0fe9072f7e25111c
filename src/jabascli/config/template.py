"""The starting ``jabas.toml`` that ``jabas init`` writes."""

from __future__ import annotations

import json
import socket

from jabascli.devices import NodeDevices

CPU_TRAINERS = 2  # trainer processes standing for GPUs on a CPU-only machine

_TEMPLATE = """\
# jabas job configuration, written by `jabas init`.
# Every key is described in jabas.toml.example; `jabas validate -c {filename}` checks this file.

[job]
name = "{name}"
workload = {workload}   # a built-in ({builtins}) or a path to a workload .py
epochs = 10
lbs = 32                # local batch size: the same on every device (IIDP)

[batching]
gbs_min = 64            # bounds of the adaptive global batch size
gbs_max = 512
metric = "fixed"        # "similarity", "noise_scale" or "goodput" adapt the global batch size while training

[[cluster.servers]]
name = "{server}"
host = "127.0.0.1"
device_type = {device_type}
devices = {devices}{devices_comment}
memory_bytes = {memory}
vsw = 1                 # virtual stream workers per device
ga = 0                  # extra gradient-accumulation micro-steps per virtual stream worker
"""


def starting_devices(devices: NodeDevices) -> int:
    """The ``devices`` the starting config gives this node: its GPUs, or CPU_TRAINERS trainer processes."""
    return CPU_TRAINERS if devices.backend == "cpu" else devices.count


def render_starting_config(devices: NodeDevices, workload: str, filename: str = "jabas.toml") -> str:
    on_cpu = devices.backend == "cpu"
    from jabascli.workload import builtin_workloads

    return _TEMPLATE.format(
        builtins=", ".join(builtin_workloads()),
        filename=filename,
        name=workload.rsplit("/", 1)[-1].removesuffix(".py"),
        workload=json.dumps(workload),
        server=socket.gethostname().split(".")[0] or "node0",
        device_type=json.dumps(devices.device_type),
        devices=starting_devices(devices),
        devices_comment="          # no GPU: each device is one trainer process on the CPU" if on_cpu else "",
        memory=devices.memory_bytes,
    )
