"""A warm trainer process: imports torch, jabas and the job's workload ahead of time, then waits.

It lives with the command line because what it becomes is a ``jabas train`` command, run in this process
(the worker agent starts it by module name, importing nothing of ``cli``).

A worker agent keeps one spare per device of its node. When the scheduler
starts a generation, the agent hands each spare what a fresh ``jabas train``
process would get, as one JSON line on its stdin (from the agent only: a pipe
between parent and child, never the network)::

    {"argv": ["train", "-c", ...], "env": {...}, "log": "/path/to/rank.log"}

and the spare becomes that trainer: output to the log, the environment
replaced, the CPU thread count applied, then the ``jabas`` command line runs in
this process. What a move then waits for is the job's own start (rendezvous,
data, checkpoint), not a new interpreter importing torch. Run as
``python -m jabascli.cli.spare CONFIG [cpu]``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys


def warm_up(config: str, cpu: bool) -> None:
    """Import what a trainer imports and the workload's module; build its model and optimizer once.

    They are dropped: building them again in the trainer then finds torch's
    lazily imported modules loaded (a first optimizer alone costs over a second).
    On a CPU node (``cpu``: trainers compute on the CPU, as emulated servers do)
    also load the datasets, kept for the trainer this spare becomes
    (:func:`~jabascli.engine.inputs.prepare_inputs`), and run one forward and
    backward at the job's LBS, for the CPU kernels' first-call set-up; on a GPU
    node that would only take CPU time and I/O from the trainers running beside it.
    """
    import torch

    import jabascli.cli.app
    import jabascli.engine.process  # noqa: F401
    from jabascli.config import load_config
    from jabascli.workload import workload_of

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

            prepare_inputs(loaded)  # the trainer this spare becomes takes them
            # The trainer seeds every generator itself, so these random numbers change nothing.
            inputs, target = workload.synthetic_batch(job.lbs or 2)
            output = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
            workload.loss(output, target).backward()


def become(order: dict[str, object]) -> None:
    log, env, argv = order["log"], order["env"], order["argv"]
    assert isinstance(log, str) and isinstance(env, dict) and isinstance(argv, list)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))  # torch read OMP_NUM_THREADS at import, before it was set
    sys.argv = ["jabas", *[str(a) for a in argv]]
    from jabascli.cli.app import main

    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    # The trainer has closed its files, written its checkpoint (atomically, fsynced) and left the
    # process group: skip the interpreter's teardown of torch, which takes a second or more.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(config: str, cpu: bool) -> None:
    warm_up(config, cpu)
    line = sys.stdin.readline()
    if not line:
        return  # the agent let us go unused
    order = json.loads(line)
    if not isinstance(order, dict):
        raise SystemExit(2)
    become(order)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:] == ["cpu"])
