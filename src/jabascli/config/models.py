"""Typed configuration of a jabas job, as read from ``jabas.toml``.

Every section forbids unknown keys, so a misspelt key is an error rather than a
silently ignored setting. Paths are resolved by :mod:`jabascli.config.loader`
and are absolute once a config is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt

WeightSync = Literal["recommend", "sequential", "overlap"]
VswStrategy = Literal["auto", "sequential", "streams"]
BatchMetric = Literal["similarity", "noise_scale", "goodput", "fixed"]
LrScaling = Literal["linear", "sqrt", "adascale", "none"]
ScalingObjective = Literal["time", "cost"]
Precision = Literal["fp32", "bf16", "fp16"]

# Seed folder names, used when a config gives only [profiles] dir.
MEMORY_DIRNAME = "cluster_mem_profile_data"
COMPUTATION_DIRNAME = "cluster_comp_profile_data"
COMMUNICATION_DIRNAME = "comm_profile_data"
BUCKET_DIRNAME = "bucket_profile_data"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class JobConfig(Section):
    """What to train and for how long."""

    name: str = "job"
    workload: str | None = None
    """A built-in workload name (``digits``, ``resnet`` ...) or a path to a workload file."""
    data: Path | None = None
    """Dataset location handed to the workload; None means its built-in or synthetic data."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Free-form keyword options handed to the workload (model variant, learning rate ...)."""
    epochs: PositiveInt = 1
    seed: int = 0
    lbs: PositiveInt | None = None
    """Local batch size (LBS) used when no plan file is given."""
    weight_sync: WeightSync = "recommend"
    vsw_strategy: VswStrategy = "auto"
    plan: Path | None = None
    """A plan written by ``jabas solve --out``; overrides lbs and per-server vsw/ga."""
    validate_every: PositiveInt = 1
    """Run validation every this many epochs."""
    precision: Precision = "fp32"
    """``bf16``/``fp16``: forward under autocast; ``fp16`` also scales the loss (docs/engine.md)."""
    clip_grad_norm: float | None = Field(None, gt=0)
    """Clip the GBS gradient to this global L2 norm; None: the workload's ``clip_grad_norm``, if any."""
    loader_workers: NonNegativeInt | None = None
    """DataLoader worker processes per trainer; None: 0 on a CPU or emulated device, 2 per GPU."""
    bucket_cap_mb: float | None = Field(None, gt=0)
    """DDP's gradient bucket size in MiB for every trainer (``jabas train --bucket-cap-mb`` wins); None: DDP's
    own (25 MiB after a first bucket of 1 MiB), the buckets the bucket profiler measures."""


class ProfilesConfig(Section):
    """Where profiles are read from and written to (seed layout)."""

    dir: Path | None = None
    """Root of the four folders below; created by ``jabas profile`` (may not exist yet)."""
    memory: Path | None = None
    computation: Path | None = None
    communication: Path | None = None
    bucket: Path | None = None


class EmulationConfig(Section):
    """Run this server's trainers on CPU, standing for a slower, smaller device."""

    slowdown: float = Field(1.0, ge=1.0)
    """Every compute step takes this many times as long as on the CPU."""
    memory_bytes: PositiveInt
    """The device's memory budget, against which the memory profiler checks peaks."""


class ServerConfig(Section):
    """One server (node) of the cluster and its identical devices."""

    name: str = Field(min_length=1)
    host: str = "127.0.0.1"
    device_type: str = Field(min_length=1)
    devices: PositiveInt = 1
    tflops: NonNegativeFloat = 0.0
    memory_bytes: PositiveInt | None = None
    intra_bandwidth: float = Field(15.75e9, gt=0)
    """Bytes per second between devices of this server."""
    inter_bandwidth: float = Field(12.5e9, gt=0)
    """Bytes per second from this server to the others."""
    price_per_hour: NonNegativeFloat = 0.0
    ssh_user: str | None = None
    ssh_port: int = Field(22, ge=1, le=65535)
    ssh_key: Path | None = None
    sync_root: str | None = None
    """Folder on this server that relative ``jabas sync`` folders resolve against (a remote path);
    None: the same absolute path as on the node running ``jabas sync``."""
    python: str | None = None
    """The Python that runs jabas on this server, when ``jabas run`` starts its agent over SSH (a remote
    path); None: the same path as the Python running ``jabas run`` (nodes sharing one installation)."""
    vsw: PositiveInt = 1
    """Virtual stream workers (VSW) per device, used when no plan file is given."""
    ga: NonNegativeInt = 0
    """Extra gradient-accumulation (GA) micro-steps per VSW, used when no plan file is given."""
    emulate: EmulationConfig | None = None


class ClusterConfig(Section):
    servers: list[ServerConfig] = Field(default_factory=list)
    available_servers: list[str] | None = None
    """Servers the job may use; None means all of ``servers``."""


class BatchingConfig(Section):
    """Adaptive global batch size (GBS); see docs/adaptive.md."""

    gbs_min: PositiveInt | None = None
    gbs_max: PositiveInt | None = None
    initial_gbs: PositiveInt | None = None
    metric: BatchMetric = "fixed"
    """``fixed`` unless asked: a job adapts its GBS only when its config says how (and within which bounds)."""
    similarity_target: float = Field(0.1, gt=0.0, le=1.0)
    adjust_rate: float = Field(0.1, gt=0.0, le=1.0)
    """Largest relative GBS change at one adjustment."""
    adjust_interval: PositiveInt = 100
    """Iterations between GBS adjustments."""
    lr_scaling: LrScaling = "sqrt"
    """``sqrt``: at 4x the GBS it reached the target sooner and ended more accurate than ``linear`` on digits
    (SGD) and MNIST-1D (Adam); see docs/adaptive.md."""


ForecastModel = Literal["holt", "seed", "naive"]


class ScalingConfig(Section):
    """Automatic scaling across server allocations at epoch ends."""

    enabled: bool = False
    allocation_unit: PositiveInt = 1
    """GPUs per allocation unit (the seed's ``resource_alloc_unit``)."""
    objective: ScalingObjective = "time"
    """``time``: the allocation that finishes the next epoch soonest; ``cost``: the cheapest one."""
    margin: float = Field(0.05, ge=0.0, lt=1.0)
    """Move only when the best allocation's predicted time (or cost) is this fraction below the current's."""
    budget_per_epoch: NonNegativeFloat | None = None
    """Largest predicted cost of one epoch (price units, as ``price_per_hour``); None: no budget."""
    deadline_per_epoch_s: NonNegativeFloat | None = None
    """Longest predicted time of one epoch in seconds; None: no deadline."""
    move_downtime_s: NonNegativeFloat = 60.0
    """What one move (checkpoint, stop, restart on the new servers) is charged, until measured."""
    forecast: ForecastModel = "holt"
    """GBS forecast model: ``holt`` (damped trend), ``seed`` (the seed's ensemble) or ``naive``."""


class SchedulerConfig(Section):
    """The elastic runtime: ``jabas schedule`` and its ``jabas worker`` agents (docs/elastic.md)."""

    address: str = "127.0.0.1"
    port: int = Field(40000, ge=1, le=65535)
    token_file: Path | None = None
    """The shared secret (mode 0600); ``JABAS_TOKEN`` overrides it."""
    heartbeat_interval_s: float = Field(0.25, gt=0)
    """How often a worker agent reports to the scheduler."""
    heartbeat_timeout_s: float = Field(10.0, gt=0)
    """A worker silent this long is lost: its trainers are restarted elsewhere."""
    max_restarts: NonNegativeInt = 3
    """Restarts after failures before the job is given up (moves do not count)."""
    checkpoint_every: PositiveInt | None = None
    """Also checkpoint every this many iterations, so a crash loses at most that much work."""
    max_body_bytes: PositiveInt = 1_000_000
    """The scheduler answers 413 to a request whose body is larger."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long a worker agent retries an unreachable scheduler before it gives up."""
    collective_timeout_s: float = Field(300.0, gt=0)
    """A collective of the trainers (an all-reduce, a broadcast) that does not finish within this time raises
    on every rank waiting in it: a lost or hung rank fails the others instead of stopping the job for good."""
    in_place_moves: bool = True
    """Moves that keep rank 0's server keep the trainers that stay running (docs/elastic.md); false: every
    move restarts all trainers from the checkpoint."""
    recover_in_place: bool = True
    """A lost or hung trainer or node costs no step when rank 0 survives: the trainers left carry on on the
    servers left, from their memory (docs/elastic.md, "Failures"); false: every failure restarts all trainers
    from the checkpoint."""


Sharding = Literal["none", "full", "grads"]
Schedule = Literal["1f1b", "gpipe"]


class LayerStrategy(Section):
    """One entry of ``[parallel] layers``: how a range of the workload's blocks runs (Galvatron's layerwise)."""

    blocks: tuple[NonNegativeInt, NonNegativeInt]
    """``[first, last]`` block indices, inclusive."""
    tp: PositiveInt = 1
    sharding: Sharding = "none"
    checkpointing: bool = False


class ParallelConfig(Section):
    """Hybrid parallelism inside each IIDP replica (docs/hybrid.md). Absent: plain replicas, as always."""

    tp: PositiveInt = 1
    """Tensor-parallel degree; a TP group never spans two servers."""
    pp: PositiveInt = 1
    """Pipeline stages per replica."""
    stages: list[tuple[NonNegativeInt, NonNegativeInt]] | None = None
    """Each stage's ``[first, last]`` block range (inclusive); None: the blocks split evenly."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule with ``pp > 1``."""
    sharding: Sharding = "none"
    """``none``: whole replicas; ``full``: FSDP2 fully sharded (ZeRO-3); ``grads``: parameters kept
    gathered from forward to backward (``reshard_after_forward=False``, ZeRO-2-like)."""
    checkpointing: Literal["none", "full"] | list[NonNegativeInt] = "none"
    """Activation checkpointing: of no block, of every block, or of the listed block indices."""
    layers: list[LayerStrategy] | None = None
    """Per-block strategies; blocks no entry names follow the keys above."""
    plan: Literal["config", "auto"] = "config"
    """``auto``: ``jabas run`` (without a plan file) trains the hybrid planner's layout and micro-batches for its GBS
    (``jabas solve --hybrid``) instead of the keys above; ``config``: the keys above."""


class StorageConfig(Section):
    checkpoint_dir: Path = Path("checkpoints")
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints a job keeps: a corrupt newest one falls back to the one before."""
    run_dir: Path = Path("runs")
    """Metrics (CSV, JSONL, TensorBoard) go to ``run_dir/<job name>``."""


class SlurmConfig(Section):
    """``jabas slurm submit``: the batch job it writes, one heterogeneous component per device type (docs/slurm.md)."""

    partition: str | None = Field(None, pattern=r"^[A-Za-z0-9_.,-]+$")
    """``--partition`` of every component; None: the cluster's default partition."""
    time: str | None = Field(None, pattern=r"^[0-9:-]+$")
    """``--time`` (Slurm's forms: ``MM``, ``HH:MM:SS``, ``D-HH``, ...); None: the partition's default."""
    account: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$")
    select: Literal["constraint", "gres"] = "constraint"
    """How a component asks for its device type: ``--constraint=<device_type>`` (the nodes' Feature), or
    ``--gres=gpu:<device_type>:<devices>`` (the nodes' Gres)."""
    options: list[str] = Field(default_factory=list)
    """More ``#SBATCH`` options for every component, e.g. ``["--qos=high"]``: each ``--name`` or ``--name=value``."""
    release_idle: bool = False
    """Give Slurm back the nodes of servers the job has moved off (a move of the auto-scaling planner or of
    ``jabas job move``): a heterogeneous component once all its nodes are idle, else the idle nodes."""


class JabasConfig(Section):
    """A whole ``jabas.toml``."""

    job: JobConfig = Field(default_factory=JobConfig)
    profiles: ProfilesConfig = Field(default_factory=ProfilesConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    parallel: ParallelConfig | None = None
    """Hybrid parallelism (docs/hybrid.md); None: every rank holds a whole replica (plain IIDP)."""

    def server(self, name: str) -> ServerConfig:
        for server in self.cluster.servers:
            if server.name == name:
                return server
        raise KeyError(name)

    @property
    def hybrid_auto(self) -> bool:
        """The layout is the hybrid planner's (``[parallel] plan = "auto"``), wherever the job runs, at every GBS."""
        return self.parallel is not None and self.parallel.plan == "auto"

    def available(self) -> list[ServerConfig]:
        """The servers the job may use, in the order of ``available_servers``."""
        if self.cluster.available_servers is None:
            return list(self.cluster.servers)
        return [self.server(name) for name in self.cluster.available_servers]
