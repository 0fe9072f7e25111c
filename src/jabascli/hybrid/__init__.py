"""The hybrid planner's torch-free core: per-block profiles, a cost model of one iteration of a hybrid plan
(data, sharded, tensor and pipeline parallelism on servers of different device types) and the search.

See docs/hybrid-planner.md for every formula and docs/formats.md for the files.
"""
