"""A node's warm trainer server: torch, jabas and the job's workload imported, and warmed, once.

A worker agent keeps one fork server (:mod:`jabascli.forkserver`) per node, started when the agent registers
and kept for the job (:mod:`jabascli.elastic.warm`). The server imports what a trainer imports, then runs
:func:`warm_up_from_env` once; every trainer the agent starts is forked from it
and starts with all of it done: what a move or a recovery then waits for is the job's own start (rendezvous,
checkpoint), not a new interpreter importing torch. A fork leaves the server as it was, so nothing has to be
started again after a generation takes its trainers.

It lives with the command line because what each child becomes is a ``jabas train`` command (the agent names
it by module, importing nothing of ``cli``).
"""

from __future__ import annotations

import contextlib
import io
import os

from jabascli.engine.trainer_env import WARM_CONFIG_ENV, WARM_CPU_ENV


def warm_up_from_env() -> None:
    """:func:`warm_up` for the config named in ``JABAS_WARM_CONFIG``; the variables are then dropped."""
    config = os.environ.pop(WARM_CONFIG_ENV, "")
    cpu = os.environ.pop(WARM_CPU_ENV, "") == "1"
    if config:
        warm_up(config, cpu)


def warm_up(config: str, cpu: bool) -> None:
    """Import what a trainer imports and the workload's module; build its model and optimizer once.

    They are dropped: building them again in a trainer then finds torch's
    lazily imported modules loaded (a first optimizer alone costs over a second).
    On a CPU node (``cpu``: trainers compute on the CPU, as emulated servers do)
    also load the datasets, kept for the trainers forked from here
    (:func:`~jabascli.engine.inputs.prepare_inputs`), and run one forward and
    backward at the job's LBS, for the CPU kernels' first-call set-up; on a GPU
    node that would only take CPU time and I/O from the trainers running beside it.

    All of it on one thread: torch's OpenMP pool is not started here, where every
    trainer is forked from (each sets its own thread count).
    """
    import torch

    import jabascli.cli.app
    import jabascli.engine.process  # noqa: F401
    from jabascli.config import load_config
    from jabascli.workload import workload_of

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with contextlib.suppress(Exception):  # a broken config or workload fails in the trainer, where it is reported
        loaded = load_config(config)
        job = loaded.config.job
        workload = workload_of(loaded)
        model = workload.build_model()
        optimizer = workload.optimizer(model.parameters())
        workload.lr_scheduler(optimizer)
        # A checkpoint's round trip once (weights-only unpickler, load_state_dict): a rank started for a move
        # reads one while the others wait for it.
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        buffer.seek(0)
        states = torch.load(buffer, map_location="cpu", weights_only=True)
        model.load_state_dict(states["model"])
        optimizer.load_state_dict(states["optimizer"])
        if cpu:
            from jabascli.engine.inputs import prepare_inputs

            prepare_inputs(loaded)  # the trainers forked from here take them
            # The trainer seeds every generator itself, so these random numbers change nothing.
            inputs, target = workload.synthetic_batch(job.lbs or 2)
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            workload.loss(output, target).backward()
    torch.set_num_threads(threads)
