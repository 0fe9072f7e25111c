"""The trainer's place in the job: the torch.distributed environment, device and process group.

A trainer reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``, as set by ``jabas run``, ``jabas worker`` or plain
``torchrun``. Without ``WORLD_SIZE`` it is a job of one rank and needs no
rendezvous address.

Device and backend: every rank runs on ``cuda:LOCAL_RANK`` with NCCL when CUDA
is available and no server of the plan is emulated or of device type ``cpu``;
otherwise every rank runs on the CPU with gloo. (All ranks decide from the
same plan, so they agree.) With ``JABAS_SHARE_GPUS=1`` several ranks may share
a GPU (``cuda:LOCAL_RANK mod GPUs``) over gloo, since NCCL refuses two ranks on
one device: how the GPU tests run a multi-rank job on a one-GPU machine.

Generations (``JABAS_GENERATION``, set by ``jabas worker``): an elastic job's
trainers meet in a TCP store at ``MASTER_ADDR:MASTER_PORT`` that this process
keeps (rank 0 hosts it), each generation under its own key prefix ``g<N>/``.
A trainer that survives a move (:mod:`jabascli.engine.handoff`) joins the next
generation's process group through the same store, without a new connection;
the old group is retired, not destroyed, because freeing a gloo group waits
10-20 ms for its threads, which would be downtime. Rank 0 opens a generation
(key ``g<N>/open``) when it arrives; the others wait for that first, with no
practical time limit, so that ranks started ahead of a move (at an epoch end
maybe minutes away) do not run into the process group's rendezvous timeout.

Where trainers listen: the store of every job (with or without generations)
is rank 0's, bound to ``MASTER_ADDR`` only (torch's own TCPStore listens on
every interface, and a store has no authentication: anyone who reaches it can
write keys into the job); gloo's (and NCCL's) sockets are bound to the interface this
node reaches ``MASTER_ADDR`` through (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``,
unless set): loopback when the job runs on one machine. See docs/security.md.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from jabascli.engine.plan import TrainingPlan
from jabascli.engine.trainer_env import GENERATION_ENV, SHARE_GPUS_ENV
from jabascli.errors import InputError, RuntimeFailure
from jabascli.net import interface_of, listening_socket, local_address_towards

ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
OPEN_TIMEOUT = timedelta(days=7)
"""How long a rank waits for rank 0 to open its generation (the agent kills it sooner when the job fails)."""
STORE_TIMEOUT = timedelta(minutes=5)
"""Connecting to the store, and each store operation of a rendezvous."""
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""How long a collective waits for its peers, unless the job says (``[scheduler] collective_timeout_s``)."""

_stores: dict[tuple[str, int], dist.TCPStore] = {}
"""The TCP stores this process joined (or hosts, on rank 0), kept for later generations."""
_listening: list[socket.socket] = []
"""The sockets rank 0's stores listen on (bound here, to ``MASTER_ADDR`` only)."""
_retired: list[object] = []
"""Process groups of earlier generations, freed when the trainer ends (:func:`release_retired`)."""


def _sharing_gpus() -> bool:
    return os.environ.get(SHARE_GPUS_ENV) == "1"


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    generation: int | None = None
    """The elastic job's generation (``JABAS_GENERATION``); None: a plain rendezvous (``jabas run``, torchrun)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return cls(0, 1, 0, None, None)
        values = {name: _int_var(env, name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        addr = env.get("MASTER_ADDR")
        if not addr:
            raise InputError.at("environment", "MASTER_ADDR", "required when WORLD_SIZE is set")
        world, rank = values["WORLD_SIZE"], values["RANK"]
        if world < 1 or not 0 <= rank < world:
            raise InputError.at("environment", "RANK", f"rank {rank} is outside a world of size {world}")
        generation = _int_var(env, GENERATION_ENV) if GENERATION_ENV in env else None
        return cls(rank, world, values["LOCAL_RANK"], addr, values["MASTER_PORT"], generation)


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise InputError.at("environment", name, "required when WORLD_SIZE is set (see `jabas train --help`)")
    try:
        return int(value)
    except ValueError:
        raise InputError.at("environment", name, f"expected an integer (got {value!r})") from None


def choose_device(plan: TrainingPlan, env: DistEnv) -> torch.device:
    gpu_job = all(not r.emulated and r.device_type.lower() != "cpu" for r in plan.ranks)
    if gpu_job and torch.cuda.is_available():
        if _sharing_gpus():
            index = env.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            return torch.device("cuda", index)
        if env.local_rank >= torch.cuda.device_count():
            raise InputError.at(
                "environment",
                "LOCAL_RANK",
                f"local rank {env.local_rank} but this node has {torch.cuda.device_count()} CUDA devices",
            )
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(env: DistEnv, device: torch.device, timeout: timedelta = COLLECTIVE_TIMEOUT) -> bool:
    """Join the job's process group; returns False when one was already initialised (by the caller).

    ``timeout`` bounds every collective of the group (``[scheduler] collective_timeout_s``): a rank that
    waits longer for a lost or hung peer raises instead of waiting for ever.
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" and not _sharing_gpus() else "gloo"
    if env.world_size == 1 and env.master_addr is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif env.generation is None:
        assert env.master_addr is not None and env.master_port is not None
        bind_gloo_towards(env.master_addr)
        store = rendezvous_store(env.master_addr, env.master_port, env.rank == 0)
        _all_arrived(store, env)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    else:
        _join_generation(env, backend, timeout)
    return True


def _all_arrived(store: dist.Store, env: DistEnv) -> None:
    """Wait (as long as the store waits) until every rank has come to form the group.

    The group's own connection step is bound by ``timeout``, the collective timeout, which is meant for
    a peer lost in training, not for one still starting (importing torch, loading data on a busy host).
    """
    store.set(f"arrived/{env.rank}", "1")
    store.wait([f"arrived/{r}" for r in range(env.world_size)], STORE_TIMEOUT)


def rejoin(env: DistEnv, device: torch.device, timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
    """Leave the current process group and join generation ``env.generation`` through the same store."""
    _retired.append(dist.group.WORLD)
    dist.destroy_process_group()  # unregisters it; the reference above keeps gloo's threads until the end
    init_process_group(env, device, timeout)


def release_retired() -> None:
    """Free the process groups of earlier generations (before the current one goes, as at exit)."""
    _retired.clear()


def wait_for_generation(env: DistEnv) -> None:
    """Until rank 0 opens ``env.generation`` (at once for rank 0, which opens it; nothing without generations).

    Rank 0 opens a generation only once the checkpoint it resumes from is written, so a rank
    may read it as soon as this returns, before the process group exists.
    """
    if env.generation is None or env.world_size == 1:
        return
    prefix = f"g{env.generation}/"
    if env.rank == 0:
        _store(env).set(prefix + "open", "1")
    else:
        _store(env).wait([prefix + "open"], OPEN_TIMEOUT)


def _store(env: DistEnv) -> dist.TCPStore:
    assert env.master_addr is not None and env.master_port is not None
    return rendezvous_store(env.master_addr, env.master_port, env.rank == 0)


def rendezvous_store(host: str, port: int, is_master: bool, timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """The job's TCP store at ``host:port``, joined once per process; the master hosts it, bound to ``host`` only."""
    key = (host, port)
    store = _stores.get(key)
    if store is None:
        listen_fd = None
        if is_master:
            try:
                sock = listening_socket(host, port)
            except OSError as exc:
                raise RuntimeFailure.at(
                    "environment", "MASTER_ADDR", f"rank 0 cannot listen on {host}:{port}: {exc.strerror or exc}"
                ) from None
            _listening.append(sock)
            listen_fd = sock.fileno()
        store = dist.TCPStore(
            host, port, is_master=is_master, timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd
        )
        _stores[key] = store
    return store


def bind_gloo_towards(master_addr: str) -> None:
    """Make gloo and NCCL listen only on the interface this node reaches ``master_addr`` through
    (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``: each unless the user set it); without them gloo binds
    to what the host name resolves to, and NCCL to the first interface it likes."""
    unset = [name for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not os.environ.get(name)]
    if not unset:
        return
    local = local_address_towards(master_addr)
    interface = interface_of(local) if local is not None else None
    if interface is not None:
        for name in unset:
            os.environ[name] = interface


def _join_generation(env: DistEnv, backend: str, timeout: timedelta) -> None:
    assert env.master_addr is not None
    bind_gloo_towards(env.master_addr)
    wait_for_generation(env)
    store = dist.PrefixStore(f"g{env.generation}/", _store(env))
    _all_arrived(store, env)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def wrap_ddp(
    module: nn.Module, device: torch.device, bucket_cap_mb: float | None = None, same_start: bool = False
) -> DistributedDataParallel:
    """DDP over replica 0 with gradients as bucket views and no per-forward buffer broadcast.

    ``same_start``: every rank loaded the same parameters and buffers (from one checkpoint),
    so DDP's check of every parameter's shape and its broadcast of rank 0's values are
    skipped (``init_sync``): on a move they were a large part of the rendezvous.

    Buffers are kept in step by :class:`~jabascli.engine.buffers.BufferSync` at
    the end of every iteration instead (ranks run different numbers of forwards).
    ``bucket_cap_mb`` None leaves DDP's default buckets (25 MiB after a small first
    one), the buckets the bucket profiler measures and the performance model assumes.
    """
    kwargs: dict[str, object] = {"gradient_as_bucket_view": True}
    if bucket_cap_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    if same_start and "init_sync" in accepted:
        kwargs["init_sync"] = False
    if "forward_sync_buffers" in accepted:
        kwargs["forward_sync_buffers"] = False  # torch >= 2.13
    else:
        kwargs["broadcast_buffers"] = False
    return DistributedDataParallel(module, **kwargs)
