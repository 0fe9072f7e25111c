"""What the training commands print about a job's epochs: one line per epoch, and the validation table.

Shared by ``jabas run``/``jabas train`` (cli/train.py) and ``jabas run --elastic`` or on a cluster
(cli/elastic.py), which print the same results.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from jabascli.cli.common import console


def epoch_line(e: dict[str, Any]) -> str:
    parts = [f"epoch {e['epoch'] + 1}", f"train loss {num(e['train_loss'])}", f"val loss {num(e['val_loss'])}"]
    if e.get("val_accuracy") is not None:
        parts.append(f"val accuracy {e['val_accuracy']:.4f}")
    parts.append(f"{e['samples_per_s']:.0f} samples/s")
    return ", ".join(parts)


def num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def print_results(title: str, results: list[dict[str, Any]]) -> None:
    """The validation table of a run's epochs, then its last ``validation accuracy: X`` line."""
    table = Table(title=title)
    for column in ("epoch", "train loss", "val loss", "val accuracy", "samples/s"):
        table.add_column(column, justify="right")
    for r in results:
        accuracy = "-" if r["val_accuracy"] is None else f"{r['val_accuracy']:.4f}"
        table.add_row(
            str(r["epoch"] + 1), num(r["train_loss"]), num(r["val_loss"]), accuracy, f"{r['samples_per_s']:.0f}"
        )
    console.print(table)
    if results and results[-1]["val_accuracy"] is not None:
        console.print(f"validation accuracy: {results[-1]['val_accuracy']:.4f}")
