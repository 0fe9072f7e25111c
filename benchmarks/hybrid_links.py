"""The hybrid planner on two links: each link's plan, and both plans trained on both links, side by side.

Two emulated nodes (``tests/cluster.py``: network namespaces on this host, each link shaped by tbf), each one server
of ``--devices`` devices: node ``a`` an emulated 4x slower CPU, node ``b`` a 6x slower one (their trainers sleep
most of the time, so that the shared cores limit them less); tiny GPT held to
``--budget`` bytes a device (default 1.1 MB), of which the device profiles hold a tenth back (``reserve_bytes``):
the memory model under-predicts the pipeline runtime's peak (966 KB measured where 897 KB was predicted, for two
stages of this model on one server), and docs/hybrid-planner.md advises keeping a budget's last tenth free. No
device holds the whole model with AdamW then (4 x 222 KB before activations).
In one run, in a fresh folder, every namespace torn down at the end (also on failure):

1. ``jabas profile hybrid`` on the same servers placed on this machine: the block profiles (the link plays no part);
2. per link rate (``--rates``, default 1gbit and 1mbit): the link between the two nodes measured by
   ``jabas.profiler.hybrid.measure_link``, one process in each node, written as the profiles' ``inter`` link; the
   planner's plan for that link (``jabas solve --hybrid``'s search) and each plan's prediction on it;
3. per link rate, each link's plan trained by ``jabas run`` on the two nodes (agents over SSH, one sshd per node):
   the job has ``[parallel] plan = "auto"`` and that link's profiles, so its scheduler solves the plan itself (the
   benchmark checks it is the plan of step 2); the median iteration time of its steps after the first 32. In
   ``--rounds`` rounds (default 2), the order reversed every other round.

It prints, per link, both plans' predicted and measured iteration times (the median over the rounds, and each
round's): on each link the plan chosen for it should be no slower than the other link's plan. The machine's load
matters (every trainer shares its cores): ``uptime`` before and after is printed. Root only (namespaces), sshd
installed.

    .venv/bin/python benchmarks/hybrid_links.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/cluster.py, tests/sshd.py

from tests.cluster import EmulatedCluster, NodeSpec
from tests.sshd import write_key

from jabascli.config import load_config
from jabascli.engine.metrics import median_iteration_s
from jabascli.hybrid.job import load_job, plan_file, solve
from jabascli.hybrid.search import Choice
from jabascli.profiler.hybrid import write_link
from jabascli.profiles.hybrid import CollectiveTime, read_profiles, write_profiles
from jabascli.solver.plan import Plan as PlanFile
from jabascli.solver.plan import read_plan

SERVERS = (("a", "cpu-4x", 4.0), ("b", "cpu-6x", 6.0))
"""Name (also the node's), device type and emulated slowdown of each server."""
LINK_SIZES = tuple(4**k * 1024 for k in range(0, 5))
"""1 KiB to 256 KiB: a pipeline's sends are 8 KB here and tiny GPT's whole parameters 222 KB; on a 1 Mbit/s link a
larger size takes seconds a repetition."""
PORT = 29517
WARMUP = 32
"""Iterations left out at the start of each run: its first tens run slow while the other trainers still start."""
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MEASURE = (
    "import json, sys\n"
    "from jabascli.profiler.hybrid import measure_link\n"
    "link = measure_link(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sizes_bytes=tuple(json.loads(sys.argv[4])))\n"
    "print(json.dumps([r.model_dump(mode='json') for r in link.rows]))\n"
)


def config_text(
    folder: Path,
    name: str,
    args: argparse.Namespace,
    hosts: dict[str, str],
    key: Path | None,
    profiles: Path | None = None,
) -> str:
    text = (
        f'[job]\nname = "{name}"\nworkload = "gpt"\nepochs = {args.epochs}\noptions = {{ variant = "tiny" }}\n\n'
        f'[batching]\nmetric = "fixed"\ninitial_gbs = {args.gbs}\n\n[parallel]\nplan = "auto"\n\n'
        f'[profiles]\ndir = "{profiles or folder / "profiles"}"\n\n'
        f'[storage]\nrun_dir = "{folder}/runs"\ncheckpoint_dir = "{folder}/checkpoints"\n'
    )
    for server, device, slowdown in SERVERS:
        text += f'\n[[cluster.servers]]\nname = "{server}"\ndevice_type = "{device}"\ndevices = {args.devices}\n'
        text += f"emulate = {{ slowdown = {slowdown}, memory_bytes = {args.budget} }}\n"
        if server in hosts:
            text += f'host = "{hosts[server]}"\nssh_user = "root"\nssh_key = "{key}"\n'
    return text


def jabas(*args: str, cwd: Path) -> str:
    """Run the real ``jabas`` command; its output, or exit naming the command that failed."""
    done = subprocess.run(
        [sys.executable, "-m", "jabascli", *args], capture_output=True, text=True, cwd=cwd, env={**os.environ, **ENV}
    )
    if done.returncode != 0:
        sys.exit(f"`jabas {' '.join(args)}` failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def hold_back(profiles: Path, reserve: int) -> None:
    """Every device profile under ``profiles`` keeps ``reserve`` bytes free at every TP degree (``reserve_bytes``)."""
    read = read_profiles(profiles, "gpt")
    devices = {}
    for name, dev in read.devices.items():
        degrees = {t for per_tp in dev.times.values() for t in per_tp}
        devices[name] = dev.model_copy(update={"reserve_bytes": dict.fromkeys(degrees, reserve)})
    write_profiles(profiles, read.model_copy(update={"devices": devices}))


def layout(plan: PlanFile) -> tuple[object, ...]:
    """What a plan trains: its ``[parallel]`` and every rank's server and micro-batches (not its predictions)."""
    ranks = tuple((a.server, a.device_type, a.gpus, a.vsw, a.ga) for a in plan.assignments)
    return plan.gbs, plan.lbs, plan.parallel, ranks


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def measure_link(cluster: EmulatedCluster) -> list[CollectiveTime]:
    """The link between the two nodes, one measuring process in each (rank 0 in ``a``, its store there)."""
    master = cluster.node("a").address
    sizes = json.dumps(list(LINK_SIZES))
    procs = [
        cluster.popen(
            node,
            [sys.executable, "-c", MEASURE, str(rank), master, str(PORT), sizes],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )
        for rank, node in enumerate(("a", "b"))
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode != 0:
            sys.exit(f"the link measurement failed ({p.returncode}):\n{err[-3000:]}")
    return [CollectiveTime.model_validate(row) for row in json.loads(outputs[0][0].strip().splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs=2, default=["1gbit", "1mbit"], help="the two link rates (tc's units)")
    parser.add_argument("--devices", type=int, default=2, help="devices per server (default 2)")
    parser.add_argument("--budget", type=int, default=1_100_000, help="bytes per device (default 1100000)")
    parser.add_argument("--gbs", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--root", type=Path, default=None, help="keep profiles and runs here (default: a temp folder)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each plan on each link (default 2)")
    args = parser.parse_args()
    rates = list(args.rates)
    began = time.monotonic()
    print(f"before: {uptime()}")
    with tempfile.TemporaryDirectory(prefix="hybrid_links_") as tmp:
        folder = (args.root or Path(tmp)).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        local = folder / "local.toml"
        local.write_text(config_text(folder, "local", args, {}, None))
        if not (folder / "profiles").is_dir():  # a --root of an earlier run keeps its block profiles
            jabas("profile", "hybrid", "-c", str(local), cwd=folder)
        print(f"block profiles: {time.monotonic() - began:.0f} s")
        key = folder / "id_ed25519"
        (folder / "authorized_keys").write_text(write_key(key) + "\n")
        specs = [NodeSpec(name, rates[0]) for name, _, _ in SERVERS]
        with EmulatedCluster(specs) as cluster:
            hosts = {node.name: node.address for node in cluster.nodes}
            sshds = [cluster.start_sshd(node, folder / "authorized_keys", skip=False) for node in cluster.nodes]
            known_hosts = folder / "known_hosts"
            known_hosts.write_text("".join(s.known_hosts_line() for s in sshds))
            choices: dict[str, Choice] = {}
            plans: dict[str, PlanFile] = {}
            predicted: dict[tuple[str, str], float] = {}
            jobs = {}
            for rate in rates:
                for node in cluster.nodes:
                    cluster.set_rate(node, rate)
                profiles = folder / f"profiles-{rate}"
                if not profiles.is_dir():  # a --root of an earlier run keeps its links' profiles
                    rows = measure_link(cluster)
                    shutil.copytree(folder / "profiles", profiles)
                    write_link(profiles, rows, f"gloo between two emulated nodes at {rate}")
                hold_back(profiles, args.budget // 10)
                rows = read_profiles(profiles, "gpt").network.collectives
                rows = [r for r in rows if r.link == "inter"]
                send = next(r for r in rows if r.collective == "send" and r.size_bytes == 16384)
                ring = max((r for r in rows if r.collective == "all_reduce"), key=lambda r: r.size_bytes)
                print(
                    f"link {rate}: send of 16 KiB {send.seconds * 1e3:.2f} ms, all-reduce of "
                    f"{ring.size_bytes / 2**10:.0f} KiB {ring.seconds * 1e3:.1f} ms"
                )
                config = folder / f"plan-{rate}.toml"
                config.write_text(config_text(folder, f"plan-{rate}", args, hosts, key))
                jobs[rate] = load_job(load_config(config), profiles, "gpt")
                choices[rate] = solve(jobs[rate], args.gbs)
                plans[rate] = plan_file(jobs[rate], choices[rate])
            for link in rates:  # every plan priced on every link, by that link's cost model
                tp = {p.tp for r in choices[link].plan.replicas for p in r.stages}
                for plan in rates:
                    model = jobs[link].model(min(tp))
                    predicted[link, plan] = model.predict(choices[plan].plan).iteration_s
            measured: dict[tuple[str, str], list[float]] = {(link, plan): [] for link in rates for plan in rates}
            for k in range(args.rounds):  # in rounds, the order reversed every other round: the load drifts
                order = rates if k % 2 == 0 else rates[::-1]
                for link in order:
                    for node in cluster.nodes:
                        cluster.set_rate(node, link)
                    for plan in order:
                        # the scheduler plans the job itself (plan = "auto"), from the profiles of the plan's link
                        name = f"round{k}-on-{link}-plan-{plan}"
                        config = folder / f"{name}.toml"
                        config.write_text(config_text(folder, name, args, hosts, key, folder / f"profiles-{plan}"))
                        jabas("run", "-c", str(config), "--known-hosts", str(known_hosts), cwd=folder)
                        runs = folder / "runs" / name
                        trained = read_plan(min((runs / "elastic" / "worker0").glob("plan-g*.json")))
                        if layout(trained) != layout(plans[plan]):
                            sys.exit(f"the run trained {trained.to_dict()}, not the plan for {plan}")
                        found = median_iteration_s(runs / "steps.csv", warmup=WARMUP)
                        if found is not None:
                            measured[link, plan].append(found[0])
    print(f"after: {uptime()}")
    print(
        f"\ntiny GPT, GBS {args.gbs}; node a: {args.devices} x {SERVERS[0][1]}, node b: {args.devices} x "
        f"{SERVERS[1][1]}, {args.budget:,} B each; {time.monotonic() - began:.0f} s in all"
    )
    for rate in rates:
        print(f"plan for {rate}: {choices[rate].plan.describe()}")
    print(f"\n{'link':<8} {'plan for':<8} {'predicted ms':>12} {'measured ms':>12}  each round")
    for link in rates:
        for plan in rates:
            got = measured[link, plan]
            shown = f"{median(got) * 1e3:12.1f}" if got else f"{'-':>12}"
            rounds = ", ".join(f"{t * 1e3:.1f}" for t in got)
            print(f"{link:<8} {plan:<8} {predicted[link, plan] * 1e3:12.1f} {shown}  {rounds}")
    for link in rates:
        other = next(r for r in rates if r != link)
        mine, theirs = measured[link, link], measured[link, other]
        if mine and theirs:
            print(f"on {link}: {other}'s plan / its own: {median(theirs) / median(mine):.2f}x the time (measured)")


if __name__ == "__main__":
    main()
