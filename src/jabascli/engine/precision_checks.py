"""Whether this machine's torch and the plan's devices can run the job's ``[job] precision``.

These checks run before any trainer trains: in the launcher (``jabas run``, before a trainer starts) and in
every trainer (so that all ranks stop alike). Only a reduced precision (``bf16``, ``fp16``) asks torch, and
imports it then: for an ``fp32`` job these checks bring no torch into the launcher (its workload module may).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jabascli.errors import InputError

DTYPE_NAMES: dict[str, str | None] = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
"""``[job] precision`` and the torch dtype (by name) autocast runs the forward in (None: the model's own)."""

NO_NATIVE: dict[str, tuple[str, ...]] = {
    "fp16": ("K80", "K40", "K20", "M40", "M60", "M10", "GTX 9"),
    "bf16": ("K80", "K40", "K20", "M40", "M60", "M10", "GTX", "P100", "P40", "P4", "V100", "T4", "RTX 20", "TITAN V"),
}
"""GPU names (substrings of ``device_type``) without native arithmetic in that precision: fp16 needs compute
capability 5.3 (Pascal), bf16 8.0 (Ampere). Names not listed are checked on the device when a trainer starts."""


def check_job_precision_inputs(loaded: Any, plan: Any) -> None:
    """Before any trainer trains: the precision suits the plan's devices, and the plan's profiles were measured in it.

    A plan file is the solver's, made from the memory and computation profiles:
    those (where this node has them) must be of the job's precision.
    """
    precision = loaded.config.job.precision
    check_job_precision(precision, plan, loaded.path)
    if plan.from_plan_file:
        from jabascli.profiles.store import check_profiles_precision

        dirs = loaded.profile_dirs()
        check_profiles_precision(dirs.memory, dirs.computation, precision)


def check_job_precision(precision: str, plan: Any, file: Path | str | None = None) -> None:
    """Before any trainer starts: the plan's devices, and this torch where trainers run on the CPU."""
    for rank in plan.ranks:
        if rank.emulated or rank.device_type.lower() == "cpu":
            continue
        for name in NO_NATIVE.get(precision, ()):
            if name.lower() in rank.device_type.lower():
                raise InputError.at(
                    file, "job.precision", f"{precision} is not supported by {rank.device_type} (server {rank.server})"
                )
    if DTYPE_NAMES[precision] is None:
        return  # the model's own precision: every torch runs it (and torch is not imported to say so)
    import torch

    gpu_job = all(not r.emulated and r.device_type.lower() != "cpu" for r in plan.ranks)
    check_precision(precision, "cuda" if gpu_job and torch.cuda.is_available() else "cpu", file)


def check_precision(precision: str, device_type: str, file: Path | str | None = None) -> None:
    """Refuse a precision this torch cannot run on ``device_type`` (``cpu`` or ``cuda``)."""
    if DTYPE_NAMES[precision] is None:
        return
    import torch

    dtype = getattr(torch, DTYPE_NAMES[precision])
    problem = None
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        problem = f"this torch ({torch.__version__}) has no autocast on {device_type}"
    elif device_type == "cuda" and torch.cuda.is_available():
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            problem = f"{torch.cuda.get_device_name()} has no native bf16"
        elif dtype is torch.float16 and torch.cuda.get_device_capability() < (5, 3):
            problem = f"{torch.cuda.get_device_name()} (compute capability < 5.3) has no fp16 arithmetic"
    else:
        try:  # the one sure test on the CPU: does this build compute a matmul under autocast in dtype?
            with torch.autocast(device_type, dtype=dtype):
                torch.ones(2, 2) @ torch.ones(2, 2)
        except RuntimeError as exc:
            problem = f"this torch ({torch.__version__}) cannot autocast to {precision} on {device_type}: {exc}"
    if problem is not None:
        raise InputError.at(file, "job.precision", f"{precision} is not supported here: {problem}")
