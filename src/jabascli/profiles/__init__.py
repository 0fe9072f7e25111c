"""On-disk profile formats (seed layout): read, write atomically, validate."""
