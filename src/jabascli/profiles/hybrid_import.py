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
    if source == "galvatron":
        return import_galvatron(root)
    raise InputError.at(None, "--from", f"unknown source {source!r} (expected: sailor or galvatron)")


GALVATRON_SOURCE = "PKU-DAIR/Hetu-Galvatron (Apache-2.0)"
GALVATRON_DEVICE = "A100-40"  # not stated upstream; the NOTICE's best guess
MB = 2**20
GALVATRON_MBS = (1, 2, 4, 8, 16, 32, 64, 128)
GALVATRON_TP = (1, 2, 4, 8)


def import_galvatron(root: Path) -> dict[str, HybridProfiles]:
    """Galvatron's per-layer profiles (``configs/{computation,memory}_profiling_bf16_<name>.json`` with the
    hardware files ``profile_hardware/hardware_configs/*.json``) as jabas hybrid profiles, by ``<folder>/<name>``.

    Galvatron measures one layer type's forward time per sample (ms) without TP and models backward as twice the
    forward (``bct_fct_coe = 2``); memory is MB: ``parameter_size`` per layer, activations per sample by TP degree
    and with checkpointing, and the embedding/head ("other") model states and activations at the first and last
    pipeline stage. The conversion: a block per layer plus an embedding block (first) and a head block (last);
    times at TP ``t`` are ``f b / t`` plus Megatron's two all-reduces of the layer's input (``b`` times the
    checkpoint size) forward and two backward at the measured all-reduce bus bandwidth of ``t`` GPUs; model states
    count 16 bytes per parameter in bf16 with Adam (4 per "fp32-equivalent" byte: params + grads 2, Adam 2 in
    ``ModelBlocks``'s terms). Models with more than one layer type (T5, Swin) are skipped: not converted yet.
    """
    hardware = sorted(root.rglob("allreduce_bandwidth_1nodes_8gpus_per_node.json"))
    if not root.is_dir():
        raise InputError.at(root, None, "not a folder")
    if not hardware:
        raise InputError.at(root, None, "not a Galvatron folder: no allreduce_bandwidth_1nodes_8gpus_per_node.json")
    network = _galvatron_network(hardware[0].parent)
    result = {}
    for comp_path in sorted(root.rglob("computation_profiling_bf16_*.json")):
        name = comp_path.name.removeprefix("computation_profiling_bf16_").removesuffix(".json")
        mem_path = comp_path.with_name(f"memory_profiling_bf16_{name}.json")
        if not mem_path.is_file():
            continue
        try:
            converted = _galvatron_model(comp_path, mem_path, network)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            converted = None  # another of Galvatron's several layouts: not converted (a folder of none is an error)
        if converted is not None:
            result[f"{comp_path.parent.parent.name}/{name}"] = converted
    if not result:
        raise InputError.at(root, None, "not a Galvatron folder: no convertible computation/memory profile pair")
    return result


def _galvatron_network(folder: Path) -> Network:
    bandwidth = read_json(folder / "allreduce_bandwidth_1nodes_8gpus_per_node.json")
    fits = {}
    for key, gbps in bandwidth.items():  # allreduce_size_{n}_consec_{0|1}
        n = int(key.split("_")[2])
        if key.endswith("consec_1") or n not in fits:
            fits[n] = BandwidthFit(coeffs=[float(gbps)])
    p2p_path = folder / "p2p_bandwidth_2nodes_8gpus_per_node.json"
    across = min(read_json(p2p_path).values()) if p2p_path.is_file() else min(f.coeffs[0] for f in fits.values())
    inter = {n: BandwidthFit(coeffs=[float(across)]) for n in (1, 2, 4, 8)}
    source = f"{GALVATRON_SOURCE}: profile_hardware/hardware_configs"
    return Network(source=source, intra={GALVATRON_DEVICE: fits}, inter={GALVATRON_DEVICE: inter})


def _per_seq(entry: dict[str, Any], seq: str | None) -> dict[str, Any]:
    """Memory entries are either flat or keyed by sequence length: the one for ``seq`` (else the largest)."""
    if "parameter_size" in entry or "model_states" in entry:
        return entry
    keys = sorted(entry, key=int)
    return entry[seq if seq in entry else keys[-1]]


def _per_tp(value: Any, tp: int) -> float:
    if isinstance(value, dict):
        return float(value[str(tp)]) if str(tp) in value else float(value["1"]) / tp
    return float(value) / tp


def _galvatron_model(comp_path: Path, mem_path: Path, network: Network) -> HybridProfiles | None:
    comp = read_json(comp_path)
    mem = read_json(mem_path)
    if any(k.startswith("layertype_1") for k in list(comp) + list(mem)):
        return None
    layer_keys = sorted(k for k in comp if k.startswith("layertype_0"))
    other_keys = sorted(k for k in comp if k.startswith("layertype_other"))
    seq = None
    if layer_keys and "_seq" in layer_keys[-1]:  # the longest sequence profiled for both time and memory
        seqs = {k.rsplit("_seq", 1)[1] for k in layer_keys}
        raw = mem.get("layertype_0", mem.get("layertype_0_sp", {}))
        both = seqs & set(raw) if "parameter_size" not in raw else seqs
        seq = max(both or seqs, key=int)
        layer_keys = [k for k in layer_keys if k.endswith(f"_seq{seq}")]
        other_keys = [k for k in other_keys if k.endswith(f"_seq{seq}")]
    forward_ms = float(comp[layer_keys[-1]])
    other_ms = float(comp[other_keys[-1]]) if other_keys else 0.0

    def entry(key: str) -> dict[str, Any]:  # without sequence parallelism where both were profiled
        return _per_seq(mem[key] if key in mem else mem[f"{key}_sp"], seq)

    layer = entry("layertype_0")
    first = entry("other_memory_pp_on_first")
    last = entry("other_memory_pp_on_last")
    acts = layer["tp_activation_per_bsz_dict"]
    boundary = float(acts["checkpoint"]) * MB
    tps = [t for t in GALVATRON_TP if str(t) in acts]

    def block(name: str, states: Any, act: Any, params_mb: float | None = None) -> BlockInfo:
        params = {t: (params_mb * MB / t if params_mb is not None else _per_tp(states, t) * MB / 4) for t in tps}
        return BlockInfo(
            name=name,
            params_bytes=params,
            act_bytes={t: _per_tp(act, t) * MB for t in tps},
            boundary_bytes=boundary,
        )

    n_layers = 1  # the layer count is the strategy's; the benchmark repeats block 1 (see ``with_layers``)
    blocks = [block("embedding", first["model_states"], first["activation"])]
    blocks += [
        block(f"layer{i}", None, {str(t): acts[str(t)] for t in tps}, float(layer["parameter_size"]))
        for i in range(n_layers)
    ]
    blocks.append(block("head", last["model_states"], last["activation"]))
    model = ModelBlocks(
        model=comp_path.stem.removeprefix("computation_profiling_bf16_"),
        source=f"{GALVATRON_SOURCE}: {comp_path.parent.parent.name}/configs/{comp_path.name}, {mem_path.name}"
        + (f" (seq {seq})" if seq else ""),
        optimizer_bytes_per_param_byte=2.0,
        framework_bytes_per_param_byte=0.0,
        blocks=blocks,
    )
    times: dict[int, dict[int, list[tuple[float, float, float]]]] = {}
    for b in GALVATRON_MBS:
        for t in tps:
            fit = network.intra[GALVATRON_DEVICE].get(t)
            tp_comm = 0.0 if t == 1 or fit is None else 2 * 2 * (t - 1) / t * b * boundary / fit.bandwidth(b * boundary)
            f_layer = forward_ms / 1e3 * b / t + tp_comm
            f_other = other_ms / 2e3 * b / t
            row = [(f_other, 2 * f_other, 0.0)]
            row += [(f_layer, 2 * f_layer, 0.0)] * n_layers
            row.append((f_other, 2 * f_other, 0.0))
            times.setdefault(b, {})[t] = row
    device = DeviceTimes(
        device=GALVATRON_DEVICE,
        source=f"{GALVATRON_SOURCE}: {comp_path.name}",
        memory_bytes=40 * 2**30,
        devices_per_server=8,
        times=times,
    )
    return HybridProfiles(blocks=model, devices={GALVATRON_DEVICE: device}, network=network)


def with_layers(profiles: HybridProfiles, n_layers: int) -> HybridProfiles:
    """The model with its first layer (block 1) repeated ``n_layers`` times between its first and last blocks:
    a Galvatron import at a strategy's depth, or a deeper model for the planner's speed benchmark."""
    src = profiles.blocks.blocks
    blocks = [src[0], *[src[1].model_copy(update={"name": f"layer{i}"}) for i in range(n_layers)], src[-1]]
    devices = {
        d: v.model_copy(
            update={
                "times": {
                    b: {t: [rows[0], *[rows[1]] * n_layers, rows[-1]] for t, rows in per.items()}
                    for b, per in v.times.items()
                }
            }
        )
        for d, v in profiles.devices.items()
    }
    return HybridProfiles(
        blocks=profiles.blocks.model_copy(update={"blocks": blocks}), devices=devices, network=profiles.network
    )
