"""Convert published planners' profiles into jabas's hybrid profiles (``jabas profile import``).

Sailor (eth-easl/sailor, MIT license; ``../shared/reference/planners/sailor/NOTICE.md``):

* ``Planner/llm_info.json``: ``[model][tp][layer]`` -> ``params_bytes``, ``act_mem_bytes`` (activation bytes kept
  per sample), ``act_output_bytes`` (the layer's output per sample);
* ``Planner/simulations/profiles_tmp.json``: ``[model][gpu][mbs][tp][layer] = [fwd, bwd, update]`` seconds;
* ``Planner/simulations/configs/basic_cluster_config.json``: devices per server and memory per device (bytes);
* ``providers/network_coeffs_all_homo.json``: ``{intra|inter}[gpu][n] = [[c0, c1, c2], cap]`` bandwidth fits.

Sailor's simulator charges, per parameter byte of fp32 DeepSpeed/Megatron training with Adam, 2 bytes of optimizer
state and 2 of further copies (a communication buffer and DeepSpeed's extra copy), and 2 GB (TP 1) or 3 GB (TP > 1)
of memory outside tensors (``runtime_simulator.py``); the import records the same constants.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jabascli.errors import InputError
from jabascli.hybrid.plan import Placement, Plan, Replica
from jabascli.inputs import read_json
from jabascli.profiles.hybrid import (
    BandwidthFit,
    BlockInfo,
    DeviceTimes,
    HybridProfiles,
    ModelBlocks,
    Network,
)

SAILOR_SOURCE = "eth-easl/sailor sosp25_ae (MIT)"


def _find(root: Path, name: str, what: str) -> Path:
    if not root.is_dir():
        raise InputError.at(root, None, "not a folder")
    hits = sorted(root.rglob(name))
    if not hits:
        raise InputError.at(root, None, f"not a {what} folder: no {name} under it")
    return hits[0]


def _expect_dict(value: Any, path: Path, field: str) -> dict[str, Any]:
    if not isinstance(value, dict) or not value:
        raise InputError.at(path, field, "expected a non-empty JSON object")
    return value


def import_sailor(root: Path) -> dict[str, HybridProfiles]:
    """Every model of a Sailor checkout (or the reference folder) as jabas hybrid profiles, by model name."""
    info_path = _find(root, "llm_info.json", "Sailor")
    times_path = _find(root, "profiles_tmp.json", "Sailor")
    cluster_path = _find(root, "basic_cluster_config.json", "Sailor")
    network_path = _find(root, "network_coeffs_all_homo.json", "Sailor")
    info = _expect_dict(read_json(info_path), info_path, "")
    times = _expect_dict(read_json(times_path), times_path, "")
    cluster = _expect_dict(read_json(cluster_path), cluster_path, "")
    network = _sailor_network(_expect_dict(read_json(network_path), network_path, ""), network_path)
    result = {}
    for model, by_tp in info.items():
        if model not in times:
            continue
        try:
            blocks = _sailor_blocks(model, by_tp)
            devices = {
                gpu: _sailor_device(gpu, per_mbs, cluster[gpu], len(blocks.blocks))
                for gpu, per_mbs in times[model].items()
                if gpu in cluster
            }
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise InputError.at(info_path.parent, model, f"unexpected Sailor layout ({err!r})") from None
        result[model] = HybridProfiles(blocks=blocks, devices=devices, network=network)
    if not result:
        raise InputError.at(info_path, None, "no model has both sizes (llm_info.json) and times (profiles_tmp.json)")
    return result


def _sailor_blocks(model: str, by_tp: dict[str, Any]) -> ModelBlocks:
    layers = sorted(by_tp["1"], key=int)
    blocks = [
        BlockInfo(
            name=layer,
            params_bytes={int(tp): float(by_tp[tp][layer]["params_bytes"]) for tp in by_tp},
            act_bytes={int(tp): float(by_tp[tp][layer]["act_mem_bytes"]) for tp in by_tp},
            boundary_bytes=float(by_tp["1"][layer]["act_output_bytes"]),
        )
        for layer in layers
    ]
    return ModelBlocks(
        model=model,
        source=SAILOR_SOURCE + ": Planner/llm_info.json",
        optimizer_bytes_per_param_byte=2.0,
        framework_bytes_per_param_byte=2.0,
        blocks=blocks,
    )


def _sailor_device(gpu: str, per_mbs: dict[str, Any], server: dict[str, Any], num_blocks: int) -> DeviceTimes:
    times: dict[int, dict[int, list[tuple[float, float, float]]]] = {}
    for mbs, per_tp in per_mbs.items():
        for tp, per_layer in per_tp.items():
            rows = [tuple(float(v) for v in per_layer[str(i)]) for i in range(num_blocks)]
            times.setdefault(int(mbs), {})[int(tp)] = rows  # type: ignore[assignment]
    tps = {tp for per_tp in times.values() for tp in per_tp} | {1}
    return DeviceTimes(
        device=gpu,
        source=SAILOR_SOURCE + ": Planner/simulations/profiles_tmp.json, configs/basic_cluster_config.json",
        memory_bytes=float(server["mem_per_gpu"]),
        devices_per_server=int(server["gpus_per_node"]),
        reserve_bytes={tp: 2e9 if tp == 1 else 3e9 for tp in sorted(tps)},
        times=times,
    )


def _sailor_network(raw: dict[str, Any], path: Path) -> Network:
    def fits(table: Any, field: str) -> dict[str, dict[int, BandwidthFit]]:
        try:
            return {
                gpu: {int(n): BandwidthFit(coeffs=list(v[0]), cap=float(v[1])) for n, v in per_n.items()}
                for gpu, per_n in table.items()
            }
        except (TypeError, ValueError, IndexError, AttributeError) as err:
            raise InputError.at(path, field, f"expected [[c0, c1, c2], cap] per device count ({err!r})") from None

    if "intra" not in raw or "inter" not in raw:
        raise InputError.at(path, None, "expected 'intra' and 'inter' tables")
    return Network(
        source=SAILOR_SOURCE + ": providers/network_coeffs_all_homo.json",
        intra=fits(raw["intra"], "intra"),
        inter=fits(raw["inter"], "inter"),
    )


def read_sailor_plan(path: Path, block_counts: dict[str, int]) -> tuple[str, Plan, float, float]:
    """A Sailor validation plan (``Planner/simulations/validation/**/plan_config_*.json``) as a jabas plan.

    Returns the model (the imported model whose block count the plan covers), the plan, and what was measured
    when it ran: iteration seconds (``real``) and peak bytes (``max_mem``). Sailor gives every replica
    ``ceil(gbs / (mbs * dp))`` micro-batches; each stage replica is one server.
    """
    raw = _expect_dict(read_json(path), path, "")
    try:
        (pipe,) = raw["pipeline_list"]
        mbs, gbs = int(raw["mbs"]), int(raw["gbs"])
        lengths = [len(layers) for layers in pipe["layers_per_stage"]]
        dp = int(pipe["dp"][0])
        stages = pipe["tmp_per_stage"]
        replicas = []
        micro = -(-gbs // (mbs * dp))
        for j in range(dp):
            places = tuple(
                Placement(device=str(stages[s][j][0][0][0]), tp=int(stages[s][j][1]), server=f"s{s}r{j}")
                for s in range(len(lengths))
            )
            replicas.append(Replica(stages=places, microbatches=micro))
        measured = float(raw["real"]), float(raw["max_mem"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise InputError.at(path, None, f"not a Sailor plan_config file ({err!r})") from None
    total = sum(lengths)
    models = [m for m, n in block_counts.items() if n == total]
    if not models:
        raise InputError.at(path, "layers_per_stage", f"{total} layers: no imported model has that many blocks")
    bounds = tuple([0, *[sum(lengths[: k + 1]) for k in range(len(lengths))]])
    return models[0], Plan(mbs=mbs, bounds=bounds, replicas=tuple(replicas)), *measured


def import_profiles(source: str, root: Path) -> dict[str, HybridProfiles]:
    """``jabas profile import --from SOURCE``: the planner's published profiles as jabas's, by model."""
    if source == "sailor":
        return import_sailor(root)
    raise InputError.at(None, "--from", f"unknown source {source!r} (expected: sailor)")
