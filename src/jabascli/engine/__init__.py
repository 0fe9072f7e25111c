"""The IIDP runtime: trainer, VSW execution, weight sync, data, checkpoint."""
