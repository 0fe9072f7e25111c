"""Data loading: a loading-bound job trained with ``loader_workers = 0`` and ``2``, side by side.

The script writes a folder of JPEG files with Pillow (an ImageFolder tree of
``--images`` photos-sized pictures, ``--size`` pixels wide, in 10 classes), then
trains the built-in ``resnet`` workload, variant ``tiny`` at 32x32, on it with
``jabas run`` (one trainer, one intra-op thread): every sample is a real JPEG
decode, a random resized crop and a random flip. Per round it trains once
with each ``loader_workers`` value, and prints the training samples/s of the
last epoch of each (the first one includes starting the workers) and the
ratio of their medians over the rounds::

    loader_workers=0   samples/s per round ...   median M0
    loader_workers=2   samples/s per round ...   median M2
    ratio=M2/M0        (target >= 1.5 on 2 cores)

The figure depends on free cores: on a machine shared with other jobs the
workers compete with them for the CPU.

Run: ``.venv/bin/python benchmarks/data_loading.py [--images 384 --rounds 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import numpy as np
import tomli_w
from PIL import Image

from jabascli.config import load_config
from jabascli.engine.launch import run_local
from jabascli.engine.options import TrainOptions

CLASSES = 10


def write_images(root: Path, count: int, size: int) -> None:
    """``count`` JPEG files (``size`` x ``size * 3/4``) of smooth random colour fields with noise, in 10 classes."""
    rng = np.random.default_rng(0)
    height = size * 3 // 4
    yy, xx = np.mgrid[0:height, 0:size].astype(np.float32)
    for i in range(count):
        folder = root / "train" / f"class{i % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        phase = rng.uniform(0, 2 * np.pi, 3)
        freq = rng.uniform(0.005, 0.05, 3)
        channels = [127 + 100 * np.sin(freq[c] * (xx + yy * (c + 1)) + phase[c]) for c in range(3)]
        pixels = np.stack(channels, axis=-1) + rng.normal(0, 20, (height, size, 3))
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.jpg", quality=90)


def train(folder: Path, data: Path, workers: int, lbs: int, epochs: int) -> float:
    """Samples/s of the last epoch of a one-trainer job with ``workers`` loader workers."""
    config = {
        "job": {
            "name": f"workers{workers}",
            "workload": "resnet",
            "data": str(data),
            "options": {"variant": "tiny", "image_size": 32},
            "epochs": epochs,
            "lbs": lbs,
            "loader_workers": workers,
            "validate_every": epochs + 1,
        },
        "cluster": {"servers": [{"name": "cpu", "device_type": "cpu", "devices": 1}]},
        "storage": {"checkpoint_dir": str(folder / "checkpoints"), "run_dir": str(folder / "runs")},
    }
    path = folder / f"workers{workers}.toml"
    path.write_bytes(tomli_w.dumps(config).encode())
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = run_local(load_config(path), TrainOptions(metrics=False), env=env)
    return float(result.done["results"][-1]["samples_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=384, help="JPEG files to write (the epoch's samples)")
    parser.add_argument("--size", type=int, default=400, help="image width in pixels (height: 3/4 of it)")
    parser.add_argument("--lbs", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run; the last one is measured")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternating")
    parser.add_argument("--workers", type=int, default=2, help="the loader_workers compared with 0")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="jabas-loading-") as tmp:
        folder = Path(tmp)
        write_images(folder / "data", args.images, args.size)
        rates: dict[int, list[float]] = {0: [], args.workers: []}
        for _ in range(args.rounds):
            for workers in rates:
                rates[workers].append(train(folder, folder / "data", workers, args.lbs, args.epochs))
    medians = {w: statistics.median(r) for w, r in rates.items()}
    for workers, values in rates.items():
        shown = " ".join(f"{v:7.1f}" for v in values)
        print(f"loader_workers={workers}   samples/s per round {shown}   median {medians[workers]:.1f}")
    print(
        f"ratio={medians[args.workers] / medians[0]:.2f}   loader_workers={args.workers} / 0 (target >= 1.5 on 2 cores)"
    )


if __name__ == "__main__":
    main()
