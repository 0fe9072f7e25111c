"""Pipeline stages inside a replica (``torch.distributed.pipelining``), exact under IIDP.

The workload's blocks are split into ``pp`` stages (``[parallel] stages`` or an
even split); each rank of a pipeline builds the whole model alike and cuts it to
its stage (the workload's ``pipeline_stage(model, first, last)``). A replica's
micro-batches of one iteration are its pipeline micro-batches: the first stage
loads them as one batch of ``count x LBS`` samples, which the schedule (GPipe or
1F1B) cuts back into the same ``count`` micro-batches of LBS, in order. The last
stage's loss of each micro-batch is divided by the job's micro-batch count
``GBS / LBS`` and the schedule does not scale gradients (``scale_grads=False``),
so a stage's accumulated gradient is its part of the same sum plain IIDP
computes.

With ``sharding`` the stage is an FSDP2 root over the DP ranks of its
position (the same stage of every replica). The schedule turns gradient sync
off for every backward and reduce-scatters once after the last one
(``perform_reduce_grad``); :meth:`PipelineMicroBatches.run` also keeps the
parameters gathered from the first forward on, so a stage issues one all-gather
and one reduce-scatter per unit an iteration however many micro-batches its
replica runs: replicas of unequal counts never deadlock the stage's DP group.

A micro-batch is not re-seeded inside the schedule: layouts with ``pp > 1`` are
exact for models without dropout (or with ``dropout = 0``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class PipelineMicroBatches:
    """One stage of a replica's pipeline: runs the replica's micro-batches of an iteration through the schedule."""

    def __init__(
        self,
        stage_module: nn.Module,
        stage: int,
        stages: int,
        device: torch.device,
        schedule: str,
        loss: Callable[[Any, Any], torch.Tensor],
        workers: int,
        group: Any = None,
    ) -> None:
        self.stage, self.stages = stage, stages
        self.pipe = PipelineStage(stage_module, stage, stages, device, group=group)
        self.schedule_class = SCHEDULES[schedule]
        self.loss = loss
        self.workers = workers
        self._schedules: dict[int, Any] = {}

    def follow(self, workers: int) -> None:
        """A new plan: its micro-batch count ``GBS / LBS``; schedules are made anew (the LBS, so the shapes, may
        have changed)."""
        self.workers = workers
        self._schedules = {}

    def _schedule(self, count: int) -> Any:
        # One schedule per micro-batch count: the count changes with the plan (adaptive GBS).
        if count not in self._schedules:
            self._schedules[count] = self.schedule_class(
                self.pipe, n_microbatches=count, loss_fn=self._scaled_loss, scale_grads=False
            )
        return self._schedules[count]

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        return self.loss(output, target) / self.workers

    def run(self, count: int, inputs: Any = None, target: Any = None) -> list[torch.Tensor]:
        """Forward and backward of ``count`` micro-batches; ``inputs`` on the first stage, ``target`` on the last.

        Returns the last stage's scaled micro-batch losses (empty elsewhere)."""
        losses: list[torch.Tensor] = []
        if isinstance(self.pipe.submod, FSDPModule):  # gathered until the schedule's reduce (module docstring)
            self.pipe.submod.set_reshard_after_forward(False)
        schedule = self._schedule(count)
        last = self.stage == self.stages - 1
        if self.stage == 0:
            schedule.step(inputs, target=target if last else None, losses=losses if last else None)
        else:
            schedule.step(target=target if last else None, losses=losses if last else None)
        return losses
