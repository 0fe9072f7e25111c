"""IIDP at a plain loop's speed: jabas's iteration beside the plain PyTorch loop it stands for, phase by phase.

One process, one device. For each case, the loop a user would write (a batch
already on the device, ``forward``, ``backward``, ``optimizer.step()``,
``zero_grad``) and jabas's own iteration (``Trainer.train_step``: VSW
micro-steps under DDP, exact BatchNorm statistics, the loss summed for the
log) train copies of one model on the same batches, which are generated on the
device beforehand, so that both measure the engine and not the input pipeline:

    case             jabas                         plain loop
    LBS 64           LBS 64, VSW 1, GA 0           1 x 64
    LBS 32, GA 1     LBS 32, VSW 1, GA 1           2 x 32, gradients accumulated
    LBS 32, 2 VSWs   LBS 32, VSW 2 (streams)       2 x 32, gradients accumulated
    LBS 64, bf16     LBS 64, bf16 autocast         1 x 64 under bf16 autocast

(``--gbs`` scales the batches.) Blocks of ``--block`` iterations of each
alternate for ``--rounds`` rounds; a block's time is its wall time up to a
device synchronisation after its last iteration, so the host may run ahead of
the device as a training loop does. Printed per case: the median per-iteration
time of each and their ratio (issue #35's target: at most 1.03), then where the
time goes:

* phases (``data``, ``fwd``, ``bwd``, ``update``, ``overhead``; CUDA events on
  a GPU, the host clock on the CPU), per iteration, for both loops;
* host reads per iteration: ``aten._local_scalar_dense`` and friends (``.item()``,
  ``bool(tensor)``), each of which on a GPU stalls the host until the device
  has caught up, and, on CUDA, the synchronisations
  ``torch.cuda.set_sync_debug_mode`` reports;
* aten operators dispatched per micro-step, jabas's beside the plain loop's
  (host work: on a GPU every operator is a kernel launch or more).

With ``--run``, each case also trains through ``jabas run`` (its DataLoader
workers, ``--loader-workers``, feeding generated images), and the median
iteration time of its ``steps.csv`` is printed beside: the input pipeline's
cost against the batch already on the device.

On a GPU (the issue's measurement: one H200, ResNet-50 at 224x224)::

    python benchmarks/gpu_resnet50.py --run
    python benchmarks/gpu_resnet50.py --cases ga --rounds 20
    python benchmarks/gpu_resnet50.py --cudnn-benchmark   # both loops; jabas itself leaves cuDNN's default

On the CPU it runs the tiny ResNet at 32x32 (``--variant``, ``--image-size``
to change): the host-side figures are the ones to read there.

It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from jabascli.config.loader import LoadedConfig
from jabascli.config.models import JabasConfig, JobConfig
from jabascli.engine.distributed import DistEnv, init_process_group
from jabascli.engine.metrics import median_iteration_s
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import RankPlan, TrainingPlan
from jabascli.engine.sampler import Iteration
from jabascli.engine.step_policy import Precision
from jabascli.engine.timing import PhaseTimer
from jabascli.engine.trainer import Trainer
from jabascli.profiler.step import PHASES, StepTimes, phase_timer
from jabascli.workload import Workload

HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal")
"""Operators that hand a tensor's value to the host: on a GPU, each waits for the device."""


@dataclass(frozen=True)
class Case:
    """One jabas plan on one device and the plain loop it stands for."""

    name: str
    micro_batches: int
    """Micro-batches per iteration (VSW * (GA + 1)); the plain loop accumulates as many."""
    vsw: int
    ga: int
    precision: str = "fp32"

    def lbs(self, gbs: int) -> int:
        return gbs // self.micro_batches


CASES = {
    "lbs": Case("LBS {lbs}", 1, 1, 0),
    "ga": Case("LBS {lbs}, GA 1", 2, 1, 1),
    "vsw": Case("LBS {lbs}, 2 VSWs", 2, 2, 0),
    "bf16": Case("LBS {lbs}, bf16", 1, 1, 0, "bf16"),
}


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active (``with OpCounter() as ops: ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func).rsplit(".", 1)[0] if str(func).endswith(".default") else str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def host_reads(self) -> int:
        return sum(n for op, n in self.counts.items() if op.startswith(HOST_READS))


def workload_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"variant": args.variant, "image_size": args.image_size, "synthetic_size": 4096}


def trainer_for(case: Case, args: argparse.Namespace, device: torch.device) -> Trainer:
    """A one-rank jabas trainer of the case's plan, as ``jabas run`` builds it (no metrics)."""
    job = JobConfig(
        name="gpu-resnet50",
        workload="resnet",
        options=workload_options(args),
        seed=0,
        weight_sync=args.weight_sync,
        vsw_strategy="auto",
        precision=case.precision,  # type: ignore[arg-type]
        loader_workers=0,  # the batches are put in place below
    )
    loaded = LoadedConfig(JabasConfig(job=job), Path(__file__), "toml")
    rank = RankPlan(0, "local", device.type, case.vsw, case.ga)
    plan = TrainingPlan(case.lbs(args.gbs), (rank,), args.weight_sync)
    return Trainer(loaded, plan, 0, device, TrainOptions(metrics=False))


class OnDevice:
    """Stands in for the trainer's loader: the next of batches generated on the device beforehand."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> None:
        self.batches, self.device = batches, device
        self.next = 0

    def __call__(self, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.next % len(self.batches)]
        self.next += 1
        return batch


@dataclass
class Loop:
    """One side of a case: a step to call per iteration, and its micro-steps."""

    step: Callable[[PhaseTimer], None]
    micro_steps: int


def jabas_loop(trainer: Trainer, batches: list[Any]) -> Loop:
    """``train_step`` of the trainer's own iterations, their micro-batches taken from ``batches``."""
    trainer.worker_step.load = OnDevice(batches, trainer.device)  # type: ignore[assignment]

    def cycle() -> Iterator[Iteration]:
        while True:
            yield from trainer.sampler.rank_iterations(0, 0, trainer.plan, 0)

    feed = cycle()

    def step(timer: PhaseTimer) -> None:
        trainer.set_timer(timer)
        trainer.train_step(next(feed))

    return Loop(step, trainer.me.micro_steps)


def plain_loop(case: Case, workload: Workload, device: torch.device, batches: list[Any]) -> Loop:
    """The loop a user writes: forward and backward of each micro-batch (accumulated), step, zero."""
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    optimizer = workload.optimizer(model.parameters())
    precision = Precision(case.precision, device)
    fetch = OnDevice(batches, device)
    micro = case.micro_batches

    def step(timer: PhaseTimer) -> None:
        for _ in range(micro):
            inputs, target = fetch(None)
            timer.mark("data")
            with precision.autocast():
                loss = workload.loss(model(inputs), target)
            timer.mark("fwd")
            (loss / micro).backward()
            timer.mark("bwd")
        optimizer.step()
        timer.mark("update")
        optimizer.zero_grad(set_to_none=True)
        timer.mark("overhead")

    return Loop(step, micro)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_blocks(loops: dict[str, Loop], args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Median per-iteration seconds of each loop over alternating blocks (round 0 warms up)."""
    idle = PhaseTimer()
    times: dict[str, list[float]] = {name: [] for name in loops}
    for round_ in range(args.rounds + 1):
        order = list(loops) if round_ % 2 == 0 else list(reversed(loops))
        for name in order:
            synchronize(device)
            start = time.perf_counter()
            for _ in range(args.block):
                loops[name].step(idle)
            synchronize(device)
            if round_ > 0:
                times[name].append((time.perf_counter() - start) / args.block)
    return {name: statistics.median(found) for name, found in times.items()}


def phases(loop: Loop, args: argparse.Namespace, device: torch.device) -> StepTimes:
    """Median milliseconds per phase over one block."""
    timer = phase_timer(device)
    taken = []
    for _ in range(args.block):
        timer.take()
        timer.mark("overhead")
        loop.step(timer)
        taken.append(timer.take())
    return StepTimes(**{f: statistics.median(getattr(t, f) for t in taken) for f in PHASES})


def host_work(loop: Loop, device: torch.device) -> tuple[OpCounter, int | None]:
    """One iteration's operators, and on CUDA the synchronisations torch reports in it."""
    idle = PhaseTimer()
    with OpCounter() as ops:
        loop.step(idle)
    if device.type != "cuda":
        return ops, None
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loop.step(idle)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return ops, sum("synchroniz" in str(w.message) for w in caught)


def generated_batches(workload: Workload, lbs: int, count: int, device: torch.device) -> list[Any]:
    """``count`` of the workload's synthetic batches of ``lbs`` samples, on the device."""
    return [tuple(t.to(device) for t in workload.synthetic_batch(lbs)) for _ in range(count)]


def run_cell(case: Case, args: argparse.Namespace, device: torch.device, folder: Path) -> str:
    """``jabas run`` of the case with DataLoader workers: the median iteration of its steps.csv."""
    name = f"run-{case.vsw}-{case.ga}-{case.precision}"
    options = ", ".join(f"{k} = {json.dumps(v)}" for k, v in workload_options(args).items())
    config = folder / f"{name}.toml"
    config.write_text(
        f'[job]\nname = "{name}"\nworkload = "resnet"\nlbs = {case.lbs(args.gbs)}\nepochs = 1000\n'
        f'precision = "{case.precision}"\nweight_sync = "{args.weight_sync}"\nloader_workers = {args.loader_workers}\n'
        f"options = {{ {options} }}\n\n"
        f'[[cluster.servers]]\nname = "local"\ndevice_type = "{"gpu" if device.type == "cuda" else "cpu"}"\n'
        f"devices = 1\nvsw = {case.vsw}\nga = {case.ga}\n\n"
        f'[storage]\nrun_dir = "{folder}/runs"\ncheckpoint_dir = "{folder}/checkpoints"\n',
        encoding="utf-8",
    )
    steps = str(5 + args.rounds * args.block)
    command = [sys.executable, "-m", "jabascli", "run", "-c", str(config), "--max-steps", steps, "--fresh"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        return f"jabas run failed: {result.stderr.strip().splitlines()[-1:]}"
    found = median_iteration_s(folder / "runs" / name / "steps.csv")
    return "no iterations in steps.csv" if found is None else f"{found[0] * 1e3:.1f} ms"


def phase_text(times: StepTimes) -> str:
    shown = [f"{f} {getattr(times, f):.2f}" for f in PHASES]
    return ", ".join(s for s in shown if not s.endswith(" 0.00")) + f" (sum {times.total:.2f} ms)"


def measure_case(case: Case, args: argparse.Namespace, device: torch.device, folder: Path) -> list[str]:
    trainer = trainer_for(case, args, device)
    batches = generated_batches(trainer.workload, case.lbs(args.gbs), 2 * case.micro_batches, device)
    loops = {"plain": plain_loop(case, trainer.workload, device, batches), "jabas": jabas_loop(trainer, batches)}
    timed = time_blocks(loops, args, device)
    ratio = timed["jabas"] / timed["plain"]
    title = case.name.format(lbs=case.lbs(args.gbs))
    plain_what = f"{case.micro_batches} x {case.lbs(args.gbs)}" + (" accumulated" if case.micro_batches > 1 else "")
    lines = [
        f"{title}: jabas {timed['jabas'] * 1e3:.1f} ms, plain loop ({plain_what}) {timed['plain'] * 1e3:.1f} ms, "
        f"ratio {ratio:.3f}"
    ]
    for name, loop in loops.items():
        ops, syncs = host_work(loop, device)
        cuda = "" if syncs is None else f", {syncs} synchronisations (sync debug mode)"
        lines.append(
            f"  {name:5s} phases per iteration: {phase_text(phases(loop, args, device))}; "
            f"{ops.host_reads} host reads{cuda}; {ops.total / loop.micro_steps:.0f} aten ops per micro-step"
        )
    del loops, trainer
    gc.collect()  # this case's DDP goes before the next one's, and all before the process group
    if args.run:
        workers = f"{args.loader_workers} loader worker{'' if args.loader_workers == 1 else 's'}"
        lines.append(f"  jabas run ({workers}): {run_cell(case, args, device, folder)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="cuda (default when there is one) or cpu")
    parser.add_argument("--variant", default="resnet50" if cuda else "tiny", help="resnet50, resnet18 or tiny")
    parser.add_argument("--image-size", type=int, default=224 if cuda else 32, help="side of the square images")
    parser.add_argument("--gbs", type=int, default=64, help="samples per iteration (default 64)")
    parser.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    parser.add_argument("--rounds", type=int, default=10, help="alternations of the two loops' blocks (default 10)")
    parser.add_argument("--block", type=int, default=10, help="iterations per block (default 10)")
    parser.add_argument("--weight-sync", default="sequential", choices=("sequential", "overlap"))
    parser.add_argument("--run", action="store_true", help="also train each case with jabas run (loader workers)")
    parser.add_argument("--loader-workers", type=int, default=6, help="jabas run's [job] loader_workers (default 6)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument(
        "--cudnn-benchmark",
        action="store_true",
        help="torch.backends.cudnn.benchmark = True for both loops (a plain loop's usual setting; jabas sets none)",
    )
    args = parser.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; expected some of {', '.join(CASES)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"{name}; torch {torch.__version__}; ResNet {args.variant} at {args.image_size}x{args.image_size}, "
        f"GBS {args.gbs}, {args.rounds} rounds of {args.block} iterations per loop"
        + (", cudnn.benchmark" if args.cudnn_benchmark else ""),
        flush=True,
    )
    init_process_group(DistEnv(0, 1, 0, None, None), device)
    try:
        with tempfile.TemporaryDirectory(prefix="jabas-gpu-resnet50-") as tmp:
            for key in args.cases.split(","):
                case = CASES[key]
                if case.micro_batches > 1 and args.gbs % case.micro_batches:
                    print(f"{key}: skipped, GBS {args.gbs} does not split into {case.micro_batches} micro-batches")
                    continue
                for line in measure_case(case, args, device, Path(tmp)):
                    print(line, flush=True)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
