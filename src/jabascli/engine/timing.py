"""Where a rank's iteration time goes: phase boundaries, for the computation profiler.

The trainer calls :meth:`PhaseTimer.mark` at every boundary between the phases
of its iteration; the default timer ignores the calls (a no-op method call per
boundary, a handful per micro-step), so training pays nothing for them. The
computation profiler (``jabas profile comp``) runs the same training step with
a timer that records them, so the profile measures exactly what the engine
runs. The phases, as the profile and the performance model name them:

``data``
    seeding a worker's generators and loading its micro-batch onto the device;
``fwd``
    a worker's forward pass and loss, with the BatchNorm statistics it writes;
``bwd``
    a worker's backward pass (for the rank's last one, DDP's reducer and the
    communication hook, which on its own adds the other VSW replicas' gradients);
``update``
    the optimizer step (``sequential`` weight sync);
``copy``
    copying replica 0's updated parameters to the other VSW replicas;
``overhead``
    the rest of the iteration, once per iteration: zeroing gradients, the
    running-statistics snapshot, all-reduce launch and write-back, the LR
    scheduler, and the training loop between two iterations.
"""

from __future__ import annotations

PHASES = ("data", "fwd", "bwd", "copy", "update", "overhead")


class PhaseTimer:
    """Receives phase boundaries; this default ignores them."""

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in ``phase``."""
