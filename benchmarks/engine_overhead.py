"""Engine overhead: jabas iterations against plain DistributedDataParallel on the same samples.

Two gloo processes on this machine train copies of one small CNN with
BatchNorm on the same synthetic images. Each rank alternates ``--block``
iterations of jabas (a real :class:`~jabascli.engine.trainer.Trainer` step:
VSW micro-steps, exact BatchNorm statistics, loss all-reduce) with ``--block``
iterations of plain DDP (default settings, ``optimizer.step()``,
``zero_grad()``), for ``--rounds`` rounds, and prints the median iteration
time of each and their ratio::

    ratio=X   jabas (VSW 1, GA 0) / DDP
    ratio=X   jabas (VSW 2, GA 0) / DDP with 2 accumulation micro-steps (no_sync, then sync)

With ``--device cuda`` both processes run on the GPU (each on ``cuda:rank`` with
NCCL when there are two GPUs; on one GPU both share it over gloo, since NCCL
refuses two ranks on one device), and iterations are timed after a CUDA
synchronisation.

Run: ``.venv/bin/python benchmarks/engine_overhead.py [--rounds 12 --block 5 --lbs 32 --device cpu]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from jabascli.config import load_config
from jabascli.engine.data import to_device
from jabascli.engine.distributed import SHARE_GPUS_ENV, DistEnv, init_process_group
from jabascli.engine.options import TrainOptions
from jabascli.engine.plan import load_plan
from jabascli.engine.sampler import Iteration
from jabascli.engine.trainer import Trainer
from jabascli.net import free_port

WORKLOAD = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

def build_model(options):
    w = int(options["width"])
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1, bias=False), nn.BatchNorm2d(2 * w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * w * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )

def train_dataset(options):
    g = torch.Generator().manual_seed(0)
    n = int(options["samples"])
    return TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))

def loss(output, target):
    return F.cross_entropy(output, target)

def optimizer(params, options):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)

def synthetic_batch(n, options):
    return torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,))
"""

CONFIG = """
[job]
name = "overhead"
workload = "{workload}"
lbs = {lbs}
options = {{ width = {width}, samples = {samples} }}
loader_workers = 0  # both sides load in the training process, and train_step is called directly

[[cluster.servers]]
name = "local"
device_type = "{device_type}"
devices = 2
vsw = {vsw}

[storage]
run_dir = "{folder}/runs"
checkpoint_dir = "{folder}/checkpoints"
"""


def write_config(folder: Path, vsw: int, args: argparse.Namespace) -> Path:
    workload = folder / "overhead_workload.py"
    workload.write_text(WORKLOAD)
    samples = 2 * vsw * args.lbs * args.block * 2  # two blocks' worth, reused every round
    path = folder / f"vsw{vsw}.toml"
    path.write_text(
        CONFIG.format(
            workload=workload,
            lbs=args.lbs,
            width=args.width,
            samples=samples,
            vsw=vsw,
            folder=folder,
            device_type="gpu" if args.device == "cuda" else "cpu",
        )
    )
    return path


def rank_main(rank: int, port: int, configs: list[str], args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        if torch.cuda.device_count() < 2:
            os.environ[SHARE_GPUS_ENV] = "1"  # both ranks on the one GPU, over gloo
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    init_process_group(DistEnv(rank, 2, rank, "127.0.0.1", port), device)
    lines = [measure(Path(config), rank, args, device) for config in configs]
    gc.collect()  # free every DDP before its process group
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")


def measure(config: Path, rank: int, args: argparse.Namespace, device: torch.device) -> str:
    """Alternate blocks of jabas and DDP iterations on the same samples; rank 0 returns the figures."""
    loaded = load_config(config)
    plan = load_plan(loaded)
    trainer = Trainer(loaded, plan, rank, device, TrainOptions(metrics=False))
    iterations = list(trainer.sampler.rank_iterations(0, 0, plan, rank))
    workload, dataset = trainer.workload, trainer.train_set

    torch.manual_seed(loaded.config.job.seed)
    cuda = device.type == "cuda"
    ddp = DistributedDataParallel(workload.build_model().to(device), device_ids=[device.index] if cuda else None)
    optimizer = workload.optimizer(ddp.parameters())
    micro_steps = plan.rank(rank).micro_steps

    def ddp_step(iteration: Iteration) -> None:
        *local, last = iteration.micro_batches
        with ddp.no_sync():
            for mb in local:
                x, y = to_device(default_collate([dataset[i] for i in mb.indices]), device)
                (workload.loss(ddp(x), y) / micro_steps).backward()
        x, y = to_device(default_collate([dataset[i] for i in last.indices]), device)
        (workload.loss(ddp(x), y) / micro_steps).backward()
        optimizer.step()
        optimizer.zero_grad()

    times: dict[str, list[float]] = {"jabas": [], "ddp": []}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, step in (("jabas", trainer.train_step), ("ddp", ddp_step)):
            for i in range(args.block):
                iteration = iterations[(round_ * args.block + i) % len(iterations)]
                dist.barrier()
                start = time.perf_counter()
                step(iteration)
                if cuda:
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - start
                if round_ > 0:
                    times[name].append(elapsed)
    gathered: list[dict[str, list[float]]] = [{}, {}]
    dist.all_gather_object(gathered, times)
    # An iteration takes as long as its slowest rank.
    jabas, ddp_time = (
        statistics.median(max(pair) for pair in zip(gathered[0][name], gathered[1][name], strict=True))
        for name in ("jabas", "ddp")
    )
    vsw = plan.rank(0).vsw
    what = (
        "jabas VSW 1, GA 0 vs DDP" if vsw == 1 else f"jabas VSW {vsw}, GA 0 vs DDP with {vsw} accumulation micro-steps"
    )
    return (
        f"ratio={jabas / ddp_time:.3f}  ({what}; median iteration {jabas * 1e3:.1f} ms vs {ddp_time * 1e3:.1f} ms, "
        f"{len(times['ddp'])} iterations each, LBS {plan.lbs}, weight sync {trainer.weight_sync}, "
        f"VSW strategy {trainer.vsw_name})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="alternations of jabas and DDP blocks (default 12)")
    parser.add_argument("--block", type=int, default=5, help="iterations per block (default 5)")
    parser.add_argument("--lbs", type=int, default=32, help="local batch size (default 32)")
    parser.add_argument("--width", type=int, default=32, help="channels of the first convolution (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both ranks train (default cpu)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        configs = [str(write_config(folder, vsw, args)) for vsw in (1, 2)]
        out = folder / "result.txt"
        mp.spawn(rank_main, args=(free_port(), configs, args, str(out)), nprocs=2)
        sys.stdout.write(out.read_text())


if __name__ == "__main__":
    main()
