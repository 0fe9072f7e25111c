"""A change of layout between two iterations: adaptive batching's hybrid plans (docs/adaptive.md, "Re-planning a
hybrid job").

LBS and micro-batch counts change in place (:meth:`~jabascli.engine.trainer.Trainer.apply_plan`). Another
``[parallel]`` layout cannot: the model is split into stages, sliced, sharded and wrapped for its layout, and the
optimizer's state lives in those pieces. So a change of layout is a move in place that keeps every process and
the process group:

1. the trainer takes the new plan as *pending* (:attr:`Trainer.relayout`) after the iteration whose adjustment
   chose it, records it in the GBS history at that step, and stops there;
2. every rank writes its shards (DCP, the checkpoint written at any stop), which holds the new plan and the
   adaptive state under it;
3. the same process builds a trainer for the new plan (its layout, new sub-groups of the same process group),
   which restores from that checkpoint, resharded (DCP restores under any layout), and trains on.

Exactness is that of a resume under another layout (``tests/test_hybrid_trainer.py``), which
``tests/test_hybrid_replan.py`` checks across two GBS changes against the reference with the same history. Unlike
a move (:mod:`jabascli.engine.handoff`) there is no new generation: the world and every rank's place stay.
"""

from __future__ import annotations

from jabascli.engine.plan import TrainingPlan


def changes_layout(current: TrainingPlan, new: TrainingPlan) -> bool:
    """Whether ``new`` runs under another layout than ``current`` (not a change in place)."""
    return new.parallel != current.parallel
