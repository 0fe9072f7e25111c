"""Hybrid parallelism inside an IIDP replica (docs/hybrid.md): the layout, built in one place."""
