"""Profilers: memory, computation, gradient buckets, all-reduce (see docs/profiling.md).

=================  ============================================================
``memory``         largest VSW count per LBS: doubling then bisection, one process per trial
``comp``           per-phase time per (LBS, VSW count), medians and quartiles
``bucket``         the gradient buckets DDP forms, via a communication hook
``comm``           all-reduce time per message size (``comm_worker``: one process of it)
``summary``        a profile folder as rows of LBS x server
``step``           the measured training step: n VSW replicas, data/fwd/bwd/copy/update
``trial``          one memory trial or computation run, in a child process
``child``          runs children (fresh, or forked by a fork server) and follows their progress
``common``         the device being profiled, progress reporting, output folders
=================  ============================================================

Files are read and written only through :mod:`jabascli.profiles`. Peak tensor
memory on the CPU (the analogue of ``max_memory_allocated``) is measured by
:mod:`jabascli.memtrack`, which the engine uses too, for emulated devices.
"""
