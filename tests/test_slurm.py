"""A real Slurm over emulated nodes (tests/slurm.py), and jabas jobs submitted to it.

Root only, and where Slurm 22.05 and munge are installed (``make test`` installs them as root).
"""

from __future__ import annotations

from pathlib import Path

from tests.cluster import EmulatedCluster, NodeSpec, cluster_factory  # noqa: F401 (the fixture)
from tests.slurm import SlurmCluster, SlurmNodeSpec, slurm_factory  # noqa: F401 (the fixture)

NODES = [NodeSpec("n0", "1gbit"), NodeSpec("n1", "1gbit"), NodeSpec("n2", "200mbit")]
SLURM_NODES = [SlurmNodeSpec("n0", "fast", 1), SlurmNodeSpec("n1", "fast", 1), SlurmNodeSpec("n2", "slow", 1)]


def test_slurm_runs_tasks_in_each_nodes_namespace(cluster_factory, slurm_factory, tmp_path: Path) -> None:  # noqa: F811
    cluster: EmulatedCluster = cluster_factory(NODES)
    slurm: SlurmCluster = slurm_factory(cluster, SLURM_NODES)
    address = {node.name: node.address for node in cluster.nodes}

    assert slurm.states() == {"n0": "idle", "n1": "idle", "n2": "idle"}

    # One task per node, each in its node's namespace: it sees that node's address only.
    result = slurm.run(["srun", "-N3", "--label", "sh", "-c", 'echo "$SLURMD_NODENAME $(hostname -I)"'])
    seen = dict(line.split(": ", 1)[1].split() for line in result.stdout.splitlines())
    assert seen == address, result.stdout

    # A heterogeneous job: one component per feature, one step across both.
    show = ["sh", "-c", 'echo "$SLURM_PROCID $SLURMD_NODENAME $(hostname -I)"']
    result = slurm.run(["srun", "--constraint=fast", "-N1", ":", "--constraint=slow", "-N1", *show])
    lines = sorted(result.stdout.split("\n")[:-1])
    assert len(lines) == 2, result.stdout
    (rank0, fast, fast_ip), (rank1, slow, slow_ip) = (line.split() for line in lines)
    assert (rank0, rank1, slow, slow_ip) == ("0", "1", "n2", address["n2"]), result.stdout
    assert fast in ("n0", "n1") and fast_ip == address[fast], result.stdout
    assert slurm.wait_queue_empty() == []
