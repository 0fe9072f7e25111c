"""Hybrid profiles: what the cost model knows about a model's blocks, each device type and the network.

Three kinds of files under ``<profiles>/hybrid/`` (docs/formats.md)::

    <model>/blocks.json             per block: parameter bytes, activation bytes per sample, by TP degree
    <model>/device-<type>.json      per block: forward, backward, update seconds by micro-batch size and TP degree
    network.json                    per device type: bandwidth fits of collectives within and across servers

A bandwidth fit gives the bus bandwidth of a message of ``S`` bytes as
``bw(S) = min(cap, 1e9 * polyval(coeffs, log2(S / 1e6)))`` bytes/s (Sailor's form, which also fits a constant:
``coeffs = [b]``); the fit for ``n`` devices of a server is their aggregate bandwidth when all ``n`` send at once.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jabascli.atomic import atomic_write_json
from jabascli.errors import InputError
from jabascli.inputs import read_json

BLOCKS_FORMAT = "jabas-hybrid-blocks/1"
DEVICE_FORMAT = "jabas-hybrid-device/1"
NETWORK_FORMAT = "jabas-hybrid-network/1"
Link = Literal["intra", "inter"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BlockInfo(_Strict):
    """One block of the model (an embedding, a transformer layer, a head), device-independent sizes."""

    name: str
    params_bytes: dict[int, float]
    """Parameter bytes held by one device at each TP degree (key)."""
    act_bytes: dict[int, float]
    """Activation bytes kept for backward, per sample, at each TP degree."""
    boundary_bytes: float
    """Bytes of the block's output per sample: what a pipeline stage ending here sends, and all that a
    checkpointed block keeps until its recompute."""


class ModelBlocks(_Strict):
    format: Literal["jabas-hybrid-blocks/1"] = BLOCKS_FORMAT
    model: str
    source: str = ""
    optimizer_bytes_per_param_byte: float = 2.0
    """Optimizer state per parameter byte (Adam in fp32: 2)."""
    framework_bytes_per_param_byte: float = 0.0
    """Further copies the training framework keeps per parameter byte (communication buffers, fp32 masters)."""
    step_bytes_per_param_byte: float = 0.0
    """What the optimizer step allocates and frees again, per parameter byte it updates (foreach temporaries: 2.9
    for AdamW on a CPU); 0 in imported profiles."""
    output_bytes: float = 0.0
    """The model's output per sample (the logits the last pipeline stage keeps for the loss); 0 in imported ones."""
    microbatch_buffers: bool = False
    """The pipeline runtime keeps every micro-batch's received activations and gradients, and the last stage every
    micro-batch's output, for the whole iteration (jabas's runtime, ``torch.distributed.pipelining``: set by ``jabas
    profile hybrid``); False in imported profiles, whose planners' runtimes reuse them."""
    blocks: list[BlockInfo]

    def params(self, block: int, tp: int) -> float:
        return _at_tp(self.blocks[block].params_bytes, tp, f"block {self.blocks[block].name} params_bytes")

    def activations(self, block: int, tp: int) -> float:
        return _at_tp(self.blocks[block].act_bytes, tp, f"block {self.blocks[block].name} act_bytes")


class ShardedTimes(_Strict):
    """One block's seconds as an FSDP2 unit, in an iteration whose micro-batches keep the parameters gathered from
    the first forward to the last backward (the runtime's ``sharding = "full"`` with unequal micro-batch counts)."""

    fwd_first: float
    """Forward of the iteration's first micro-batch: the unit's all-gather included."""
    fwd: float
    """Forward of any later micro-batch (FSDP2's hooks, no collective)."""
    bwd: float
    """Backward of any micro-batch but the last (gradients accumulate unsharded)."""
    bwd_last: float
    """Backward of the last micro-batch: the unit's reduce-scatter included."""
    update: float
    """The block's share of the optimizer step on the shards."""


class DeviceTimes(_Strict):
    format: Literal["jabas-hybrid-device/1"] = DEVICE_FORMAT
    device: str
    source: str = ""
    memory_bytes: float
    devices_per_server: int = Field(ge=1)
    reserve_bytes: dict[int, float] = {}
    """Memory the framework takes besides tensors (CUDA context, kernels, allocator), by TP degree."""
    times: dict[int, dict[int, list[tuple[float, float, float]]]]
    """``times[mbs][tp][block] = (forward, backward, update)`` in seconds for one micro-batch of ``mbs`` samples."""

    checkpointed: dict[int, list[tuple[float, float]]] = {}
    """``checkpointed[mbs][block] = (forward, backward)`` at TP 1 with the block checkpointed, the backward with its
    recompute, as ``jabas profile hybrid`` measures it; absent in imported profiles (then checkpointing costs one more
    forward)."""

    sharded: dict[int, list[ShardedTimes]] = {}
    """``sharded[mbs][block]``: the block as an FSDP2 unit over ``sharded_over`` data-parallel ranks (TP 1), as
    ``jabas profile hybrid`` measures it; absent in imported profiles (then sharded plans are priced without it)."""
    sharded_over: int = 2

    def reserve(self, tp: int) -> float:
        if not self.reserve_bytes:
            return 0.0
        return self.reserve_bytes.get(tp, max(self.reserve_bytes.values()))

    def block_times(self, mbs: int, tp: int) -> list[tuple[float, float, float]] | None:
        return self.times.get(mbs, {}).get(tp)


class BandwidthFit(_Strict):
    coeffs: list[float]
    cap: float = math.inf
    """Largest bandwidth, bytes/s."""

    def bandwidth(self, size_bytes: float) -> float:
        x = math.log2(max(size_bytes, 1.0) / 1e6)
        gbps = 0.0
        for c in self.coeffs:
            gbps = gbps * x + c
        return max(min(self.cap, gbps * 1e9), 1e6)

    def seconds(self, size_bytes: float) -> float:
        return size_bytes / self.bandwidth(size_bytes) if size_bytes > 0 else 0.0


class CollectiveTime(_Strict):
    """One measured collective: ``collective`` of ``size_bytes`` (per device) over ``devices`` devices."""

    collective: Literal["all_reduce", "all_gather", "reduce_scatter", "send"]
    devices: int = Field(ge=2)
    link: Link
    size_bytes: float
    seconds: float


class Network(_Strict):
    format: Literal["jabas-hybrid-network/1"] = NETWORK_FORMAT
    source: str = ""
    intra: dict[str, dict[int, BandwidthFit]] = {}
    """``intra[device][n]``: n devices of one server exchanging among themselves."""
    inter: dict[str, dict[int, BandwidthFit]] = {}
    """``inter[device][n]``: n devices of one server exchanging with other servers, aggregate."""
    collectives: list[CollectiveTime] = []
    """What ``jabas profile hybrid`` measured, as measured (the fits above come from its all-reduces)."""

    def measured_seconds(self, collective: str, link: Link, size_bytes: float) -> float | None:
        """``collective`` of ``size_bytes`` over ``link`` from the measured rows, interpolated linearly in size (the
        smallest's time below it, the largest's bandwidth above it); None where none was measured. A small message
        is latency, which the bandwidth fits (through all-reduces, in log size) miss by up to 10x."""
        rows = sorted(
            (r.size_bytes, r.seconds) for r in self.collectives if r.collective == collective and r.link == link
        )
        if not rows:
            return None
        if size_bytes <= rows[0][0]:
            return rows[0][1]
        for (s0, t0), (s1, t1) in itertools.pairwise(rows):
            if size_bytes <= s1:
                return t0 + (t1 - t0) * (size_bytes - s0) / (s1 - s0)
        return rows[-1][1] * size_bytes / rows[-1][0]

    def with_link(
        self, link: Link, rows: list[CollectiveTime], fit: BandwidthFit, devices: int, source: str
    ) -> Network:
        """This network with ``link`` measured anew: its rows replaced by ``rows`` and every device type's fit for
        it by ``fit`` (for ``devices`` devices of a server), ``source`` saying where the link was measured."""
        types = sorted(set(self.intra) | set(self.inter))
        kept = [r for r in self.collectives if r.link != link]
        measured = [r.model_copy(update={"link": link}) for r in rows]
        update: dict[str, object] = {
            link: {t: {devices: fit} for t in types},
            "collectives": kept + measured,
            "source": "; ".join(filter(None, (self.source.split(f"; {link}: ")[0], f"{link}: {source}"))),
        }
        return self.model_copy(update=update)

    def fit(self, link: Link, device: str, n: int) -> BandwidthFit:
        table = (self.intra if link == "intra" else self.inter).get(device)
        if not table:
            raise InputError.at("network.json", f"{link}.{device}", "no bandwidth fit for this device type")
        fitting = [k for k in table if k >= n] or [max(table)]
        return table[min(fitting)]


def _at_tp(values: dict[int, float], tp: int, what: str) -> float:
    if tp in values:
        return values[tp]
    if 1 in values:  # a TP degree that was not measured: split evenly (an estimate, said in the docs)
        return values[1] / tp
    raise InputError.at(None, what, f"no value for TP degree {tp} (have {sorted(values)})")


class HybridProfiles(BaseModel):
    """Everything the cost model reads for one model."""

    blocks: ModelBlocks
    devices: dict[str, DeviceTimes]
    network: Network

    @property
    def num_blocks(self) -> int:
        return len(self.blocks.blocks)


def model_dir(folder: Path, model: str) -> Path:
    """``<folder>/hybrid/<model>``: one model's block and device files."""
    return folder / "hybrid" / model


def blocks_file(model_folder: Path) -> Path:
    return model_folder / "blocks.json"


def device_file(model_folder: Path, device: str) -> Path:
    return model_folder / f"device-{device}.json"


def network_file(folder: Path) -> Path:
    """``<folder>/hybrid/network.json``, shared by every model profiled under ``folder``."""
    return folder / "hybrid" / "network.json"


def profiled_models(folder: Path) -> list[str]:
    """The models with a block profile under ``<folder>/hybrid/``, sorted."""
    return sorted(p.parent.name for p in (folder / "hybrid").glob("*/blocks.json"))


def write_profiles(folder: Path, profiles: HybridProfiles) -> list[Path]:
    """Write one model's hybrid profiles (each file atomically) and return the paths."""
    where = model_dir(folder, profiles.blocks.model)
    written = [atomic_write_json(blocks_file(where), profiles.blocks.model_dump(mode="json"), indent=1)]
    for name, dev in sorted(profiles.devices.items()):
        written.append(atomic_write_json(device_file(where, name), dev.model_dump(mode="json"), indent=1))
    written.append(atomic_write_json(network_file(folder), profiles.network.model_dump(mode="json")))
    return written


def _parse(model: type[BaseModel], path: Path) -> BaseModel:
    try:
        return model.model_validate(read_json(path))
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise InputError.at(path, field, first["msg"]) from None


def read_profiles(folder: Path, model: str) -> HybridProfiles:
    """Read one model's hybrid profiles from ``<folder>/hybrid/``."""
    where = model_dir(folder, model)
    if not blocks_file(where).is_file():
        raise InputError.at(blocks_file(where), None, "no hybrid block profile (run `jabas profile import`)")
    blocks = _parse(ModelBlocks, blocks_file(where))
    devices = {}
    for path in sorted(where.glob("device-*.json")):
        dev = _parse(DeviceTimes, path)
        assert isinstance(dev, DeviceTimes)
        devices[dev.device] = dev
    network = _parse(Network, network_file(folder))
    assert isinstance(blocks, ModelBlocks) and isinstance(network, Network)
    return HybridProfiles(blocks=blocks, devices=devices, network=network)
