"""What a launcher (``jabas run``, a node's agent) tells each trainer it starts (its entry, and through the environment,
beyond torch.distributed's ``RANK``, ``WORLD_SIZE`` and ``MASTER_*``).

Only the names live here, so that a launcher sets them without importing torch: a node's agent never loads it.
"""

from __future__ import annotations

GENERATION_ENV = "JABAS_GENERATION"
"""The job generation the trainer belongs to; set by the elastic agent, absent for a one-machine ``jabas run``."""
CONTROL_FILE_ENV = "JABAS_CONTROL_FILE"
"""The file through which rank 0 is asked to stop at an epoch end or now (:mod:`jabascli.engine.control`)."""
SHARE_GPUS_ENV = "JABAS_SHARE_GPUS"
"""``1``: several ranks may share one GPU (an emulated cluster on one machine)."""
TRAINER_ENTRY = "jabascli.cli.app:main"
"""What a fork server runs in a trainer it forks, as ``python -m jabascli`` would: a trainer is ``jabas train``."""
WARM_UP = "jabascli.cli.spare:warm_up_from_env"
"""What a node's warm trainer server runs once after its imports (named: the agent imports nothing of ``cli``)."""
WARM_CONFIG_ENV = "JABAS_WARM_CONFIG"
"""The job's config file, which the warm trainer server warms up for."""
WARM_CPU_ENV = "JABAS_WARM_CPU"
"""``1``: the node's trainers compute on the CPU (as emulated servers do): the data and kernels are warmed too."""
