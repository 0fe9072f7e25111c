"""Does every server pull its weight? A fast server beside an emulated slower one, as a user runs them.

For each workload (digits, MNIST-1D, tiny ResNet, tiny ViT), each slow server
(``--slowdowns``, default 1.5x and 3x slower than the fast CPU one) and each
GBS (``--gbs``, default 64 and 256), through the commands a user types:

1. ``jabas profile all`` once per (workload, slow server), GBS up to the
   largest, both servers in one folder of their own (its time printed beside
   the time it said it expected). The fast server is profiled again beside
   each slow server: the emulated servers share one host, whose speed drifts
   by more than 10% over minutes, so a fast server's profile from another
   slow server's ``profile all`` 15 minutes before misstates the two servers'
   ratio in a way two real machines' profiles do not (the sixteenth run,
   which reused it, lost all four ResNet/ViT 1.5x rows to uneven DDP at
   0.91-0.93x; profiled together, the same rows measured 1.00-1.11x);
2. ``jabas solve --servers fast`` / ``slow`` / ``auto`` (jabas's own choice,
   the default of ``jabas run``), each plan trained with ``jabas run --plan``;
   where ``auto`` left the slow server out, ``--servers all`` too (was
   leaving it out right?);
3. plain DDP: both servers at LBS ``GBS / 2``, one worker each;
4. uneven-batch DDP (``uneven_ddp.py``): one process per server, the GBS
   split in proportion to the samples/s each server alone measured in the
   first round of step 2 (as a user would tune it: from measured speeds),
   each rank's loss weighted by its share, so the same SGD; measured in the
   same rounds as the plans, side by side (A B C U, U C B A);
5. the online model: every plan measured in the first round (each server
   alone, jabas's, plain DDP: its iteration time and each rank's busy time,
   ``busy.csv``) refits the model (``jabas run`` does this
   after every solved run; here it is called directly, since these runs
   train plan files); the plan the refit model then chooses (``refit plan``)
   is trained too when it differs, and so are the runners-up ``jabas run``'s
   trial would try beside it (``cli/trial.py``: where the refit model cannot
   tell them apart), side by side with jabas's offline plan in the same
   rounds; "after refit and trial" is the fastest of them, as its speed over
   the offline plan's (``x1.03``), and "its /uneven" that ratio times the
   offline plan's over uneven DDP (each measured side by side); the model's
   error on jabas's plan is printed before (the offline profiles' prediction against the mean of the
   rounds) and after the refit (its prediction against the rounds after the
   first, which it did not see; with one round, the first: in sample).

The runs of a row are measured in ``--rounds`` rounds (default 2), the order
reversed every other round (A B C, C B A), and each figure is the mean of its
rounds; a row where jabas's plan is within 0.95-1.03x of a baseline gets two
rounds more at a time, up to ``--max-rounds`` (default 6), without the slow
server alone (no target compares jabas with it). This host's speed
drifts over minutes: the same fast-server run of digits measured 14.2, 18.6
and 15.4 ms per iteration within half an hour, which is more than some of the
gains compared here; reversed rounds cancel a drift that is linear over the
row, and the per-row line prints every round.

Printed per row: samples/s of each server alone, of jabas's plan and of plain
DDP on both, of uneven-batch DDP, the efficiency (jabas over the sum of the two
alone; its limit is below 1 by the all-reduce), jabas over DDP and over uneven
DDP, and jabas's predicted beside its measured iteration time (median of
``steps.csv`` after 5 warm-up iterations), before and after the refit. Beside
jabas over uneven DDP stands the 95% interval of that ratio from its rounds
taken in pairs (each round's jabas over the same round's uneven DDP, Student's
t): a row whose interval holds 1 cannot tell the two apart on this host.
Every trainer runs at one thread (``OMP_NUM_THREADS=1``), so that "alone" and
"together" share the machine alike; the load average is printed before and
after (on a busy machine, two trainers side by side each lose part of a core).

    .venv/bin/python benchmarks/heterogeneous_efficiency.py                  # everything, 70 min to 2 h on 2 cores
    .venv/bin/python benchmarks/heterogeneous_efficiency.py --quick          # tiny ResNet, 3x, GBS 64
    .venv/bin/python benchmarks/heterogeneous_efficiency.py --workloads resnet,vit --slowdowns 3
    .venv/bin/python benchmarks/heterogeneous_efficiency.py --repeat 3 --also resnet:2.5:128   # issue #35's check

With ``--repeat N`` the whole benchmark runs N times in a row, each run profiling
afresh in its own folder, and then prints each row's worst figure over the runs
against the targets: jabas at least 0.98x the fast server alone, plain DDP and
uneven-batch DDP, and efficiency at least 0.85 on ResNet and ViT.

It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import t as t_dist

from jabascli.cli.trial import plan_trial
from jabascli.config import load_config
from jabascli.engine.metrics import median_busy_s, median_iteration_s
from jabascli.engine.steplog import LOG_INTERVAL_S
from jabascli.errors import InputError
from jabascli.solver import read_plan, solver_from_config, write_plan
from jabascli.solver.autoplan import RunPlan
from jabascli.solver.choice import choose_plan
from jabascli.solver.online import learn_from_run
from jabascli.solver.plan import Assignment, Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from uneven_ddp import UnevenSpec, median_after_warmup, split_batch, train_uneven

WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "digits": ("digits", {"width": 16}),
    "mnist1d": ("mnist1d", {"train_samples": 8000, "val_samples": 0}),
    "resnet": ("resnet", {"variant": "tiny", "synthetic_size": 16384}),
    "vit": ("vit", {"variant": "tiny", "synthetic_size": 16384}),
}

CONFIG = """\
[job]
name = "{name}"
workload = "{workload}"
epochs = 1000
lbs = 16
options = {options}

[batching]
metric = "fixed"
gbs_min = {gbs_min}
gbs_max = {gbs_max}
initial_gbs = {gbs_min}

[profiles]
dir = "{root}/profiles/{key}_x{slowdown:g}"

[[cluster.servers]]
name = "fast"
device_type = "cpu"
devices = 1

[[cluster.servers]]
name = "{slow}"
device_type = "cpu-x{slowdown:g}"
devices = 1
emulate = {{ slowdown = {slowdown}, memory_bytes = 2_000_000_000 }}

[storage]
run_dir = "{root}/runs"
checkpoint_dir = "{root}/checkpoints"
"""


def toml_inline(options: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in options.items()) + " }"


def jabas(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "jabascli", *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"jabas {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
    return result


@dataclass
class Measured:
    plan: Plan
    predicted_s: float | None
    measured_s: float
    iterations: int
    rounds: list[float] = field(default_factory=list)
    """Each round's median iteration time, when several runs were averaged."""
    busy: dict[int, float] = field(default_factory=dict)
    """Each rank's median busy time (``busy.csv``) in the first round."""

    @classmethod
    def mean(cls, runs: list[Measured]) -> Measured:
        """Several runs of one plan as one: the mean of their medians."""
        times = [r.measured_s for r in runs]
        first = runs[0]
        iterations = sum(r.iterations for r in runs)
        return cls(first.plan, first.predicted_s, statistics.fmean(times), iterations, times, first.busy)

    def per_round(self) -> str:
        """`` (rounds 16466/s, 15980/s)``; empty for a single run."""
        if len(self.rounds) < 2:
            return ""
        return " (rounds " + ", ".join(f"{self.plan.gbs / t:.0f}/s" for t in self.rounds) + ")"

    @property
    def samples_per_s(self) -> float:
        return self.plan.gbs / self.measured_s

    @property
    def servers(self) -> str:
        return "+".join(a.server for a in self.plan.assignments)


class Bench:
    def __init__(self, root: Path, key: str, workload: str, options: dict[str, Any], slowdown: float, gbs: list[int]):
        self.root, self.key, self.slowdown, self.runs = root, key, slowdown, 0
        self.slow = f"slow{slowdown:g}"
        self.fields = {
            "slow": self.slow,
            "workload": workload,
            "options": toml_inline(options),
            "gbs_min": min(gbs),
            "gbs_max": max(gbs),
            "root": root,
            "key": key,
            "slowdown": slowdown,
        }
        self.config = self.write_config(f"{key}_x{slowdown:g}")
        # The same job whose model learns from the runs (its refits in its own run folder): self.config's
        # plans stay the offline profiles' own.
        self.online = self.write_config(f"{key}_x{slowdown:g}_online")

    def write_config(self, name: str) -> Path:
        path = self.root / f"{name}.toml"
        path.write_text(CONFIG.format(name=name, **self.fields), encoding="utf-8")
        return path

    def profile_all(self) -> dict[str, Any]:
        began = time.monotonic()
        report = json.loads(jabas("profile", "all", "-c", str(self.config), "--json").stdout)
        report["wall_s"] = time.monotonic() - began
        return report

    def solve(self, gbs: int, servers: str, config: Path | None = None) -> Plan:
        tag = "" if config is None else f"_{config.stem}"
        out = self.root / "plans" / f"{self.key}_x{self.slowdown:g}_{gbs}_{servers.replace(',', '+')}{tag}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        jabas(
            "solve",
            "-c",
            str(config or self.config),
            "--gbs",
            str(gbs),
            "--servers",
            servers,
            "--out",
            str(out),
            "--json",
        )
        return read_plan(out)

    def ddp(self, gbs: int) -> Plan:
        lbs = gbs // 2
        assignments = (Assignment("fast", "cpu", 1, 1, 0), Assignment(self.slow, f"cpu-x{self.slowdown:g}", 1, 1, 0))
        plan = Plan(gbs, lbs, "sequential", None, None, assignments)
        try:
            solver = solver_from_config(load_config(self.config), f"fast,{self.slow}", "sequential")
            predicted = solver.predict(plan).time_s
        except InputError:  # no profile at LBS GBS / 2: trained, not predicted
            return plan
        return Plan(gbs, lbs, "sequential", predicted, gbs / predicted, assignments)

    def train(self, plan: Plan, steps_budget_s: float, quick: bool, steps: int | None = None) -> Measured:
        """``jabas run --plan`` for about ``steps_budget_s`` seconds (or exactly ``steps`` iterations)."""
        self.runs += 1
        name = f"{self.key}_x{self.slowdown:g}_run{self.runs}"
        config = self.write_config(name)
        path = write_plan(self.root / "plans" / f"{name}.json", plan)
        predicted = plan.iteration_time_s or None
        guess = predicted or 0.5
        # steps.csv has a row per LOG_INTERVAL_S at most: a fast workload needs many steps for a few rows.
        seconds = max(steps_budget_s, 4 * LOG_INTERVAL_S)
        steps = steps or max(12 if quick else 15, min(5000, 5 + math.ceil(seconds / guess)))
        # --fresh: a --root kept from an earlier invocation holds checkpoints under the same run names.
        jabas("run", "-c", str(config), "--plan", str(path), "--max-steps", str(steps), "--fresh")
        found = median_iteration_s(self.root / "runs" / name / "steps.csv")
        if found is None:
            raise RuntimeError(f"{name}: no iterations in steps.csv")
        busy = median_busy_s(self.root / "runs" / name / "busy.csv")
        return Measured(plan, predicted, found[0], found[1], busy=busy)

    def uneven(self, batches: list[int], guess_s: float, args: argparse.Namespace) -> float:
        """One run of uneven-batch DDP with these local batches; its median iteration time (s)."""
        workload, options = WORKLOADS[self.key]
        steps = max(12 if args.quick else 15, min(5000, 5 + math.ceil(max(args.seconds, 1.0) / guess_s)))
        spec = UnevenSpec(workload, options, tuple(batches), (1.0, self.slowdown), steps)
        with tempfile.TemporaryDirectory(prefix="uneven-", dir=self.root) as folder:
            return median_after_warmup(train_uneven(spec, Path(folder)))

    def refit(self, gbs: int, measured: dict[str, Measured], mine: Measured, args: argparse.Namespace) -> Refit:
        """Refit the model to every plan's first round; predict jabas's plan again; solve and train the refit plan."""
        loaded = load_config(self.online)
        for run in measured.values():
            if run.plan.iteration_time_s is not None:
                iterations = max(1, run.iterations // max(1, len(run.rounds)))
                learn_from_run(loaded, run.plan, (run.rounds or [run.measured_s])[0], iterations, busy=run.busy)
        predicted = None
        with contextlib.suppress(InputError):
            predicted = solver_from_config(load_config(self.online)).predict(mine.plan).time_s
        later = mine.rounds[1:] or mine.rounds or [mine.measured_s]
        error = (statistics.fmean(later) - predicted) / predicted if predicted else None
        plan = self.solve(gbs, "auto", self.online)
        others: dict[str, Plan] = {}
        if plan.shape() != mine.plan.shape():
            others["refit"] = plan
        # jabas run's runner-up trial under the refit model: its runners-up, where the model cannot tell them apart.
        online = load_config(self.online)
        choice = choose_plan(online, gbs)
        trial = plan_trial(online, RunPlan(choice.plan, "--gbs", choice), None, 0)
        runners_up = trial.runners_up if trial is not None else ()
        for i, other in enumerate(runners_up):
            if other.shape() not in (mine.plan.shape(), plan.shape()):
                others[f"runner-up {i + 1}"] = other
        # Side by side with the offline plan, in the same rounds: minutes after the row's own rounds, this host
        # has drifted by more than the gains compared.
        found = measure_rounds(self, {"offline": mine.plan, **others}, args) if others else {}
        sides = {name: Side(found[name], found[name].samples_per_s / found["offline"].samples_per_s) for name in others}
        # A runner-up of the offline plan's or the refit plan's shape was measured as that plan.
        by_shape = {mine.plan.shape(): Side(mine, 1.0), **{others[n].shape(): s for n, s in sides.items()}}
        tried = [by_shape[other.shape()] for other in runners_up]
        return Refit(predicted, error, plan, sides.get("refit"), tried)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="digits,mnist1d,resnet,vit", help="comma list of " + ",".join(WORKLOADS))
    parser.add_argument("--slowdowns", default="3,1.5", help="the slow server's slowdowns (each profiled beside the "
                        "fast server)")  # fmt: skip
    parser.add_argument("--gbs", default="64,256", help="GBS values, small to large")
    parser.add_argument("--also", action="append", default=[], metavar="WORKLOAD:SLOWDOWN:GBS", help="one more "
                        "case after the others, e.g. resnet:2.5:128 (repeatable)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="whole runs in a row, each profiling afresh in its "
                        "own folder; then each row's worst figure over the runs against the targets")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per run, about")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every plan of a row, in reversed order "
                        "each other round; figures are their means")  # fmt: skip
    parser.add_argument("--max-rounds", type=int, default=6, help="rounds of a row whose jabas plan is within "
                        "0.95-1.03x of a baseline (two more at a time; default 6)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny ResNet, 3x, GBS 64, short runs, one round")
    parser.add_argument("--root", type=Path, default=None, help="keep profiles and runs here (default: a temp folder)")
    args = parser.parse_args()
    if args.quick:
        args.workloads, args.slowdowns, args.gbs, args.seconds, args.rounds = "resnet", "3", "64", 2.0, 1
        args.max_rounds = 1
    if args.rounds < 1 or args.repeat < 1:
        parser.error("--rounds and --repeat must be at least 1")
    try:
        cases = parse_cases(args)
    except ValueError as exc:
        parser.error(str(exc))
    root = args.root or Path(tempfile.mkdtemp(prefix="jabas-hetero-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: list[list[tuple[Any, ...]]] = []
    for n in range(args.repeat):
        folder = root if args.repeat == 1 else root / f"run{n + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        if args.repeat > 1:
            print(f"\nrun {n + 1} of {args.repeat}", flush=True)
        runs.append(run_once(cases, folder, args))
    if args.repeat > 1:
        print()
        print(targets_table(runs))


Case = tuple[str, float, list[int]]
"""A workload, its slow server's slowdown and the GBS values measured on that pair (one ``profile all``)."""


def parse_cases(args: argparse.Namespace) -> list[Case]:
    """Every (workload, slowdown) of ``--workloads`` x ``--slowdowns`` at ``--gbs``, then each ``--also``."""
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)} (expected some of {', '.join(WORKLOADS)})")
    gbs_values = [int(g) for g in args.gbs.split(",")]
    cases = [(key, float(s), gbs_values) for key in workloads for s in args.slowdowns.split(",")]
    for extra in args.also:
        key, _, rest = extra.partition(":")
        slowdown, _, gbs = rest.partition(":")
        try:
            if key not in WORKLOADS or float(slowdown) < 1 or not gbs.isdigit():
                raise ValueError
        except ValueError:
            raise ValueError(f"--also {extra}: expected WORKLOAD:SLOWDOWN:GBS, e.g. resnet:2.5:128") from None
        cases.append((key, float(slowdown), [int(gbs)]))
    return cases


def run_once(cases: list[Case], root: Path, args: argparse.Namespace) -> list[tuple[Any, ...]]:
    """One whole run: each case's ``profile all`` and rows, in ``root``; prints each row and the table."""
    print(f"before: {load()}, {os.cpu_count()} cores; every trainer at 1 thread; folder {root}", flush=True)
    began = time.monotonic()
    rows = []
    for key, slowdown, gbs_values in cases:
        workload, options = WORKLOADS[key]
        bench = Bench(root, key, workload, options, slowdown, gbs_values)
        report = bench.profile_all()
        print(
            f"{key} fast + {slowdown:g}x slower: jabas profile all took {report['wall_s']:.0f} s "
            f"(said it expected about {report['expected_s']:.0f} s; LBS {report['lbs_values']})",
            flush=True,
        )
        print("  where the time went: " + ", ".join(f"{x['name']} {x['seconds']:.0f} s" for x in report["stages"]))
        for gbs in gbs_values:
            try:
                rows.append(measure_row(bench, key, slowdown, gbs, args))
            except RuntimeError as exc:  # one failed run does not lose the others' figures
                print(f"{key} x{slowdown:g} GBS {gbs}: failed: {exc}", flush=True)
                continue
            print(row_line(rows[-1]), flush=True)
    print()
    print(table(rows))
    print(f"\nafter: {load()}; {time.monotonic() - began:.0f} s in all", flush=True)
    return rows


TARGET_RATIO = 0.98
"""jabas at least this times the fast server alone, plain DDP and uneven-batch DDP, on every row of every run."""
TARGET_EFFICIENCY = 0.85
"""jabas at least this efficiency (its samples/s over the sum of the servers' alone) on every ResNet/ViT row."""


def row_figures(row: tuple[Any, ...]) -> dict[str, float]:
    """A row's figures against the targets: jabas's offline plan over the fast server alone (``fast``), plain
    DDP (``ddp``) and uneven DDP (``uneven``), after the refit and the trial over uneven DDP (``after``), and its
    efficiency (over the sum of the two servers alone)."""
    _key, _slowdown, _gbs, fast, slow, mine, _every, ddp, uneven, refit = row
    return {
        "fast": mine.samples_per_s / fast.samples_per_s,
        "ddp": mine.samples_per_s / ddp.samples_per_s,
        "uneven": mine.samples_per_s / uneven.samples_per_s,
        "after": refit.chosen(mine).gain * mine.samples_per_s / uneven.samples_per_s,
        "efficiency": mine.samples_per_s / (fast.samples_per_s + slow.samples_per_s),
    }


def targets_table(runs: list[list[tuple[Any, ...]]]) -> str:
    """Each row's worst figure over the runs, a ``*`` where it misses its target, and how many rows of how many
    runs met every target."""
    worst: dict[tuple[str, float, int], dict[str, float]] = {}
    count: dict[tuple[str, float, int], int] = {}
    for rows in runs:
        for measured in rows:
            key, slowdown, gbs = measured[:3]
            figures = row_figures(measured)
            row = worst.setdefault((key, slowdown, gbs), figures)
            for name, value in figures.items():
                row[name] = min(row[name], value)
            count[(key, slowdown, gbs)] = count.get((key, slowdown, gbs), 0) + 1
    lines = [
        f"Worst of {len(runs)} runs (* misses its target: {TARGET_RATIO}x each rival; efficiency {TARGET_EFFICIENCY} "
        "on ResNet/ViT)",
        "| workload | slow | GBS | runs | jabas/fast | jabas/DDP | jabas/uneven | after refit and trial /uneven "
        "| efficiency |",
        "|" + " --- |" * 9,
    ]
    met = 0
    for (key, slowdown, gbs), row in worst.items():
        misses = {name for name in ("fast", "ddp", "uneven") if row[name] < TARGET_RATIO}
        if key in ("resnet", "vit") and row["efficiency"] < TARGET_EFFICIENCY:
            misses.add("efficiency")
        complete = count[(key, slowdown, gbs)] == len(runs)
        met += not misses and complete

        def cell(name: str, row: dict[str, float] = row, misses: set[str] = misses) -> str:
            return f"{row[name]:.3f}{' *' if name in misses else ''}"

        lines.append(
            f"| {key} | {slowdown:g}x | {gbs} | {count[(key, slowdown, gbs)]} | {cell('fast')} | {cell('ddp')} "
            f"| {cell('uneven')} | {row['after']:.3f} | {cell('efficiency')} |"
        )
    lines.append(f"\n{met} of {len(worst)} rows met every target in all {len(runs)} runs")
    return "\n".join(lines)


def paired_interval(mine: list[float], rival: list[float]) -> tuple[float, float] | None:
    """The 95% interval of jabas's speed over a rival's from rounds taken in pairs (iteration times, round by
    round, at the same GBS): each round's ratio ``rival_i / mine_i``, their mean plus or minus Student's t at
    ``n - 1`` degrees of freedom times the standard error. None below two pairs."""
    ratios = [r / m for m, r in zip(mine, rival, strict=False)]
    if len(ratios) < 2:
        return None
    half = float(t_dist.ppf(0.975, len(ratios) - 1)) * statistics.stdev(ratios) / math.sqrt(len(ratios))
    centre = statistics.fmean(ratios)
    return centre - half, centre + half


def interval_text(interval: tuple[float, float] | None) -> str:
    return "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}"


@dataclass
class Uneven:
    """Uneven-batch DDP of one row: each server's local batch, and the measured iteration time (mean of rounds)."""

    batches: list[int]
    measured_s: float
    rounds: list[float]

    @property
    def samples_per_s(self) -> float:
        return sum(self.batches) / self.measured_s


@dataclass
class Side:
    """A plan measured side by side with jabas's offline plan, in the same rounds, and its speed over that plan's."""

    run: Measured
    gain: float


@dataclass
class Refit:
    """What the online model made of a row's first round: jabas's plan predicted after it, and its own plan."""

    predicted_s: float | None
    """The refit model's prediction of jabas's (offline) plan."""
    error_after: float | None
    """Against the rounds after the first (in sample with one round)."""
    plan: Plan
    """The plan the refit model chooses for the row's GBS."""
    measured: Side | None
    """That plan trained beside the offline one, when it differs from it."""
    runners_up: list[Side] = field(default_factory=list)
    """The runners-up ``jabas run`` would try beside that plan (its trial), trained; empty: no trial."""

    def chosen(self, mine: Measured) -> Side:
        """What jabas runs after the refit and the trial: the fastest of the refit plan and its runners-up, as its
        speed over the offline plan's measured side by side (1 for the offline plan itself)."""
        return max([self.measured or Side(mine, 1.0), *self.runners_up], key=lambda side: side.gain)


def measure_row(bench: Bench, key: str, slowdown: float, gbs: int, args: argparse.Namespace) -> tuple[Any, ...]:
    """Each server alone, jabas's plan (and both servers' best where it left one out), plain DDP, uneven DDP,
    and the plan of the model refit to the first round."""
    plans = {"fast": bench.solve(gbs, "fast"), "slow": bench.solve(gbs, bench.slow)}
    own = bench.solve(gbs, "auto")
    if own.lbs != plans["fast"].lbs or own.shape() != plans["fast"].shape():
        plans["jabas"] = own
    if len(own.assignments) == 1:  # was leaving the slow server out right? Its best plan with both, measured too
        plans["every"] = bench.solve(gbs, "all")
    plans["ddp"] = bench.ddp(gbs)
    measured, uneven = measure_side_by_side(bench, plans, gbs, args)
    fast = measured["fast"]
    mine = measured.get("jabas", fast)
    every = measured.get("every", mine)
    refit = bench.refit(gbs, measured, mine, args)
    return (key, slowdown, gbs, fast, measured["slow"], mine, every, measured["ddp"], uneven, refit)


def measure_side_by_side(
    bench: Bench, plans: dict[str, Plan], gbs: int, args: argparse.Namespace
) -> tuple[dict[str, Measured], Uneven]:
    """Every plan and uneven DDP ``args.rounds`` times, side by side (A B C U, U C B A): this host drifts by more
    than the gaps compared, so the rival is measured in the same rounds. Uneven DDP's split is the first round's
    speeds of each server alone, as a user would tune it before training.

    A row where jabas's plan is within ``CLOSE`` of a baseline (:func:`close_call`) gets two rounds more, up to
    ``args.max_rounds``: a tie is told from a loss by more samples, not by the first two rounds' noise. The slow
    server alone is not measured in those: no target compares jabas with it."""
    runs: dict[str, list[Measured]] = {name: [] for name in plans}
    order = list(plans)
    batches: list[int] = []
    guess_s = 0.0
    uneven: list[float] = []
    r, rounds = 0, args.rounds
    while r < rounds:
        forward = r % 2 == 0
        if not forward:
            uneven.append(bench.uneven(batches, guess_s, args))
        for name in order if forward else reversed(order):
            if name == "slow" and r >= args.rounds:  # only the efficiency's sum uses it, not a close call
                continue
            runs[name].append(bench.train(plans[name], args.seconds, args.quick))
        if not batches:
            speeds = [runs["fast"][0].samples_per_s, runs["slow"][0].samples_per_s]
            batches, guess_s = split_batch(gbs, speeds), gbs / sum(speeds)
        if forward:
            uneven.append(bench.uneven(batches, guess_s, args))
        r += 1
        close = close_call(runs, uneven, batches) if r == rounds and rounds + 2 <= args.max_rounds else None
        if close is not None:
            print(f"  {bench.key} x{bench.slowdown:g} GBS {gbs}: {close}, two rounds more", flush=True)
            rounds += 2
    measured = {name: Measured.mean(found) for name, found in runs.items()}
    return measured, Uneven(batches, statistics.fmean(uneven), uneven)


CLOSE = (0.95, 1.03)
"""jabas's plan over a baseline in this range after a row's rounds: too close to call at this host's noise."""


def close_call(runs: dict[str, list[Measured]], uneven: list[float], batches: list[int]) -> str | None:
    """Which baseline jabas's plan is too close to (``"jabas/uneven 0.97"``); None when every ratio is clear of
    :data:`CLOSE`."""
    mine = statistics.fmean(m.samples_per_s for m in runs.get("jabas", runs["fast"]))
    rivals = {"ddp": statistics.fmean(m.samples_per_s for m in runs["ddp"])}
    rivals["uneven"] = statistics.fmean(sum(batches) / t for t in uneven)
    if "jabas" in runs:
        rivals["fast"] = statistics.fmean(m.samples_per_s for m in runs["fast"])
    for name, rival in rivals.items():
        if CLOSE[0] <= mine / rival < CLOSE[1]:
            return f"jabas/{name} {mine / rival:.2f}"
    return None


def measure_rounds(bench: Bench, plans: dict[str, Plan], args: argparse.Namespace) -> dict[str, Measured]:
    """Every plan ``args.rounds`` times, the order reversed every other round (A B C, C B A)."""
    runs: dict[str, list[Measured]] = {name: [] for name in plans}
    order = list(plans)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else reversed(order):
            runs[name].append(bench.train(plans[name], args.seconds, args.quick))
    return {name: Measured.mean(found) for name, found in runs.items()}


def row_line(row: tuple[Any, ...]) -> str:
    key, slowdown, gbs, fast, slow, mine, every, ddp, uneven, refit = row
    both = "" if every is mine else f", both servers' best plan {every.samples_per_s:.0f}/s"
    predicted = f"predicted {mine.predicted_s * 1e3:.1f} ms, " if mine.predicted_s else ""
    after = f"; after the refit {refit.predicted_s * 1e3:.1f} ms" if refit.predicted_s else ""
    return (
        f"{key} x{slowdown:g} GBS {gbs}: fast {fast.samples_per_s:.0f}/s{fast.per_round()}, "
        f"slow {slow.samples_per_s:.0f}/s, jabas {mine.samples_per_s:.0f}/s{mine.per_round()} "
        f"({mine.servers}, LBS {mine.plan.lbs_text()}; {predicted}measured {mine.measured_s * 1e3:.1f} ms"
        f"{after}){both}, "
        f"DDP {ddp.samples_per_s:.0f}/s, uneven DDP {uneven.samples_per_s:.0f}/s "
        f"(batches {'+'.join(map(str, uneven.batches))}; rounds "
        + ", ".join(f"{sum(uneven.batches) / t:.0f}/s" for t in uneven.rounds)
        + f"; jabas/uneven 95% {interval_text(paired_interval(mine.rounds, uneven.rounds))}), "
        f"refit plan {refit_cell(refit)}{trial_cell(refit)}"
    )


def refit_cell(refit: Refit) -> str:
    """The plan the refit model chose: ``(the same)``, or it and its speed over the offline plan's, side by side."""
    if refit.measured is None:
        return "(the same)"
    run = refit.measured.run
    return f"{run.samples_per_s:.0f}/s ({run.plan.seed_form()}, LBS {run.plan.lbs_text()}; x{refit.measured.gain:.2f})"


def trial_cell(refit: Refit) -> str:
    """``, runner-up x0.97 (LBS 39+25)``, ``, runners-up x0.97 (LBS 39+25), x1.20 (LBS 256)``: the trial's other
    plans over the offline one; nothing without a trial."""
    if not refit.runners_up:
        return ""
    label = "runner-up" if len(refit.runners_up) == 1 else "runners-up"
    return f", {label} " + ", ".join(f"x{s.gain:.2f} (LBS {s.run.plan.lbs_text()})" for s in refit.runners_up)


def both_cell(every: Measured, mine: Measured) -> str:
    """The best plan with both servers, when jabas left one out: measured, and as predicted."""
    if every is mine:
        return "(jabas's)"
    predicted = f", predicted {every.predicted_s * 1e3:.1f} ms" if every.predicted_s else ""
    return f"{every.samples_per_s:.0f}/s ({every.measured_s * 1e3:.1f} ms{predicted})"


def table(rows: list[tuple[Any, ...]]) -> str:
    head = (
        "| workload | slow | GBS | fast alone | slow alone | jabas (offline plan) | both, best plan | plain DDP "
        "| uneven DDP (batches) | efficiency | jabas/fast | jabas/DDP | jabas/uneven | its 95% | predicted | measured "
        "| error | error after refit | refit plan | after refit and trial | its /uneven |"
    )
    lines = [head, "|" + " --- |" * 21]
    for row in rows:
        key, slowdown, gbs, fast, slow, mine, every, ddp, uneven, refit = row
        figures = row_figures(row)
        both = len(mine.plan.assignments) > 1
        if mine.predicted_s and both:
            error = f"{(mine.measured_s - mine.predicted_s) / mine.predicted_s:+.0%}"
            predicted = f"{mine.predicted_s * 1e3:.1f} ms"
        else:
            error, predicted = ("-", f"{mine.predicted_s * 1e3:.1f} ms" if mine.predicted_s else "-")
        after = f"{refit.error_after:+.0%}" if refit.error_after is not None else "-"
        final = refit.chosen(mine)
        plan = f"{mine.plan.seed_form()}, LBS {mine.plan.lbs_text()}"
        lines.append(
            f"| {key} | {slowdown:g}x | {gbs} | {fast.samples_per_s:.0f}/s | {slow.samples_per_s:.0f}/s "
            f"| {mine.samples_per_s:.0f}/s ({plan}) | {both_cell(every, mine)} | {ddp.samples_per_s:.0f}/s "
            f"| {uneven.samples_per_s:.0f}/s ({'+'.join(map(str, uneven.batches))}) | {figures['efficiency']:.2f} "
            f"| {figures['fast']:.2f} | {figures['ddp']:.2f} | {figures['uneven']:.2f} "
            f"| {interval_text(paired_interval(mine.rounds, uneven.rounds))} "
            f"| {predicted} | {mine.measured_s * 1e3:.1f} ms | {error} | {after} | {refit_cell(refit)} "
            f"| x{final.gain:.2f} (LBS {final.run.plan.lbs_text()}{trial_cell(refit)}) "
            f"| {figures['after']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
