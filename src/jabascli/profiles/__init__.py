"""On-disk profile formats (seed layout): read, write atomically, validate.

This package is the one place that knows file formats; see ``formats.py``.
"""

from jabascli.profiles.formats import (
    BucketProfile,
    CommMeta,
    CommProfile,
    CompProfile,
    MemoryProfile,
    MemoryTrial,
    read_bucket_profile,
    read_comm_profile,
    read_comp_profiles,
    read_memory_profiles,
    ring_allreduce_ideal_ms,
    write_bucket_profile,
    write_comm_profile,
    write_comp_profile,
    write_memory_profile,
)
from jabascli.profiles.store import ProfileSet, load_profile_set

__all__ = [
    "BucketProfile",
    "CommMeta",
    "CommProfile",
    "CompProfile",
    "MemoryProfile",
    "MemoryTrial",
    "ProfileSet",
    "load_profile_set",
    "read_bucket_profile",
    "read_comm_profile",
    "read_comp_profiles",
    "read_memory_profiles",
    "ring_allreduce_ideal_ms",
    "write_bucket_profile",
    "write_comm_profile",
    "write_comp_profile",
    "write_memory_profile",
]
