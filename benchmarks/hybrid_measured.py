"""The hybrid planner's plan trained and measured, beside the best even-split and the best single-server plan.

Tiny GPT on a fast CPU server and an emulated 3x slower one (``--devices`` devices each), every device held to
``--budget`` bytes so that none holds the whole model with AdamW (4 x 222 KB of parameters, gradients and moments
before activations). In one run, in a fresh folder:

1. ``jabas profile all`` (the hybrid profiles; the data-parallel ones are skipped: no LBS fits);
2. ``jabas run`` on ``[parallel] plan = "auto"``: the planner's plan, trained; its "predicted X ms, measured Y ms";
3. the best plan whose pipelines split the blocks evenly over their stages, and the best plan on one server (each
   device type's alone, the faster kept), each searched by the same cost model, written as a plan file and trained
   by ``jabas run --plan``.

It prints each plan, its predicted and measured median iteration time and the error, and the ratios of the two
baselines to the planner's plan, predicted and measured. The machine's load matters (every trainer shares its
cores): the ``uptime`` before and after are printed.

    .venv/bin/python benchmarks/hybrid_measured.py --devices 1
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from jabascli.config import load_config
from jabascli.engine.metrics import median_iteration_s
from jabascli.errors import InputError
from jabascli.hybrid.job import HybridJob, load_job, plan_file, profiles_root
from jabascli.hybrid.search import Choice, ServerGroup, search
from jabascli.solver.plan import read_plan, write_plan


@dataclass
class Row:
    name: str
    plan: str
    predicted_s: float
    measured_s: float | None


def config_text(folder: Path, name: str, devices: int, budget: int, gbs: int, epochs: int) -> str:
    return (
        f'[job]\nname = "{name}"\nworkload = "gpt"\nepochs = {epochs}\noptions = {{ variant = "tiny" }}\n\n'
        f'[batching]\nmetric = "fixed"\ninitial_gbs = {gbs}\n\n[parallel]\nplan = "auto"\n\n'
        f'[profiles]\ndir = "{folder}/profiles"\n\n'
        f'[storage]\nrun_dir = "{folder}/runs"\ncheckpoint_dir = "{folder}/checkpoints"\n\n'
        f'[[cluster.servers]]\nname = "fast"\ndevice_type = "cpu"\ndevices = {devices}\nmemory_bytes = {budget}\n\n'
        f'[[cluster.servers]]\nname = "slow"\ndevice_type = "cpu-slow"\ndevices = {devices}\n'
        f"emulate = {{ slowdown = 3.0, memory_bytes = {budget} }}\n"
    )


def jabas(*args: str, fail: bool = True) -> str:
    """Run the real ``jabas`` command; its output, or exit naming the command that failed (``fail=False``: print
    why and return "")."""
    done = subprocess.run([sys.executable, "-m", "jabascli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        said = f"`jabas {' '.join(args)}` failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        if fail:
            sys.exit(said)
        print(said)
        return ""
    return done.stdout


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def measured(folder: Path, name: str) -> float | None:
    found = median_iteration_s(folder / "runs" / name / "steps.csv")
    return found[0] if found is not None else None


def baselines(job: HybridJob, gbs: int) -> dict[str, Choice]:
    """The best even-split plan, and the best plan on one server (the faster device type's alone)."""
    tp = min(job.degrees())
    model = job.model(tp)
    found = {"even split": search(model, job.servers, gbs, even_split=True, deal=True)}
    singles = []
    for group in job.servers:
        try:
            singles.append(search(model, [ServerGroup(group.device, 1)], gbs, deal=True))
        except InputError as err:
            print(f"only one {group.device} server: no plan ({'; '.join(err.lines())})")
    if singles:
        found["one server"] = min(singles, key=lambda c: c.prediction.iteration_s)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="devices per server (default 1)")
    parser.add_argument("--budget", type=int, default=900_000, help="bytes per device (default 900000)")
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--root", type=Path, default=None, help="keep profiles and runs here (default: a temp folder)")
    args = parser.parse_args()

    print(f"before: {uptime()}")
    with tempfile.TemporaryDirectory(prefix="hybrid_measured_") as tmp:
        folder = args.root or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / "planner.toml"
        config.write_text(config_text(folder, "planner", args.devices, args.budget, args.gbs, args.epochs))
        jabas("profile", "all", "-c", str(config))
        out = jabas("run", "-c", str(config))
        said = re.search(r"predicted ([\d.]+) ms, measured ([\d.]+) ms per iteration", out)
        layout = re.search(r"hybrid layout \(the planner's\): (.*)", out)
        if said is None:
            sys.exit(f"`jabas run` printed no prediction:\n{out[-2000:]}")
        planned = read_plan(folder / "runs" / "planner" / "plan.json")
        rows = [
            Row(
                "planner (plan = auto)",
                f"{planned.seed_form()}; {layout.group(1) if layout else ''}",
                float(said.group(1)) / 1e3,
                float(said.group(2)) / 1e3,
            )
        ]
        loaded = load_config(config)
        job = load_job(loaded, profiles_root(loaded), "gpt")
        for name, choice in baselines(job, args.gbs).items():
            slug = name.replace(" ", "_")
            other = folder / f"{slug}.toml"
            other.write_text(config_text(folder, slug, args.devices, args.budget, args.gbs, args.epochs))
            path = write_plan(folder / f"{slug}.json", plan_file(job, choice))
            # a baseline that fails (the memory model under-predicts a pipeline's peak) is a row without a measurement
            ran = jabas("run", "-c", str(other), "--plan", str(path), fail=False)
            got = measured(folder, slug) if ran else None
            rows.append(Row(name, choice.plan.describe(), choice.prediction.iteration_s, got))
    print(f"after: {uptime()}")

    print(f"\ntiny GPT, GBS {args.gbs}, fast + 3x slow CPU server, {args.devices} devices each, {args.budget:,} B each")
    print(f"{'plan':<22} {'predicted ms':>12} {'measured ms':>12} {'error':>7}  layout")
    for row in rows:
        got = f"{row.measured_s * 1e3:12.1f}" if row.measured_s else f"{'-':>12}"
        error = f"{(row.measured_s / row.predicted_s - 1) * 100:+6.0f}%" if row.measured_s else f"{'-':>7}"
        print(f"{row.name:<22} {row.predicted_s * 1e3:12.1f} {got} {error}  {row.plan}")
    base = rows[0]
    for row in rows[1:]:
        ratio = f"{row.measured_s / base.measured_s:.2f}x measured" if row.measured_s and base.measured_s else ""
        print(f"{row.name} / planner: {row.predicted_s / base.predicted_s:.2f}x predicted, {ratio}")


if __name__ == "__main__":
    main()
