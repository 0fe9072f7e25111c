"""The seed system's JSON job format (``config.json`` + ``cluster_info.json``).

A seed config names its profile folders and a cluster-info file; the cluster
info maps server names to GPU type, ``tfplos`` (sic), GPU count and network
bandwidths. :func:`seed_to_toml_dict` turns both into the ``jabas.toml``
structure, and :data:`TOML_TO_SEED_FIELD` names the seed key behind each
converted field so that errors point at what the user wrote.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

TOML_TO_SEED_FIELD = {
    "profiles.memory": "memory_profile_dir",
    "profiles.computation": "comp_profile_dir",
    "profiles.communication": "comm_profile_dir",
    "profiles.bucket": "bucket_profile_dir",
    "batching.gbs_min": "batch_size_lower_bound",
    "batching.gbs_max": "batch_size_upper_bound",
    "batching.similarity_target": "similarity_target",
    "cluster.available_servers": "available_servers",
    "scaling.allocation_unit": "resource_alloc_unit",
}


class SeedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_profile_dir: str | None = None
    comp_profile_dir: str | None = None
    comm_profile_dir: str | None = None
    bucket_profile_dir: str | None = None
    gpu_cluster_info: str
    batch_size_lower_bound: int | None = None
    batch_size_upper_bound: int | None = None
    similarity_target: float | None = None
    resource_alloc_unit: str | None = Field(None, pattern=r"^\d+gpu$")
    available_servers: list[str] | None = None


class SeedServer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: str
    tfplos: float
    number: int
    intra_network_bandwidth: float
    inter_network_bandwidth: float


def alloc_unit_gpus(value: str) -> int:
    """``"2gpu"`` -> 2."""
    match = re.fullmatch(r"(\d+)gpu", value)
    if match is None:
        raise ValueError(f"expected '<N>gpu', got {value!r}")
    return int(match.group(1))


def seed_to_toml_dict(seed: SeedConfig, cluster: dict[str, SeedServer]) -> dict[str, Any]:
    """The ``jabas.toml`` structure equivalent to a seed config and cluster info."""
    profiles = {
        key: value
        for key, value in {
            "memory": seed.memory_profile_dir,
            "computation": seed.comp_profile_dir,
            "communication": seed.comm_profile_dir,
            "bucket": seed.bucket_profile_dir,
        }.items()
        if value is not None
    }
    batching: dict[str, Any] = {}
    if seed.batch_size_lower_bound is not None:
        batching["gbs_min"] = seed.batch_size_lower_bound
    if seed.batch_size_upper_bound is not None:
        batching["gbs_max"] = seed.batch_size_upper_bound
    if seed.similarity_target is not None:
        batching["similarity_target"] = seed.similarity_target
    if seed.batch_size_lower_bound is not None or seed.batch_size_upper_bound is not None:
        batching["metric"] = "similarity"  # the seed adapted its GBS by gradient similarity
    servers = [
        {
            "name": name,
            # The seed reached its servers by name (ssh node1), so the name is the host.
            "host": name,
            "device_type": info.type,
            "tflops": info.tfplos,
            "devices": info.number,
            "intra_bandwidth": info.intra_network_bandwidth,
            "inter_bandwidth": info.inter_network_bandwidth,
        }
        for name, info in cluster.items()
    ]
    result: dict[str, Any] = {
        "profiles": profiles,
        "batching": batching,
        "cluster": {"servers": servers, "available_servers": seed.available_servers},
    }
    if seed.resource_alloc_unit is not None:
        result["scaling"] = {"allocation_unit": alloc_unit_gpus(seed.resource_alloc_unit)}
    return result
