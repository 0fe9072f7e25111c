"""Built-in workloads. Each module is a workload file (see ``jabascli.workload``)."""
