"""The workload interface: a Python file that says what to train.

A workload file defines these functions (``options`` is the ``[job] options``
table of the config plus ``data``, the ``[job] data`` path or None):

=====================================  ==========================================================
``build_model(options)``               the ``torch.nn.Module`` to train
``train_dataset(options)``             a map-style ``Dataset`` of ``(inputs, target)`` samples
``loss(output, target)``               a scalar: the *mean* loss of the batch
``optimizer(params, options)``         a ``torch.optim.Optimizer`` over ``params``
``synthetic_batch(batch_size, opts)``  ``(inputs, target)`` of that many random samples (profiling)
=====================================  ==========================================================

and may define:

=====================================  ==========================================================
``val_dataset(options)``               the validation ``Dataset``
``count_correct(output, target)``      how many predictions in the batch are right (accuracy)
``lr_scheduler(optimizer, options)``   a scheduler, stepped once per iteration
``collate(samples)``                   turns a list of samples into ``(inputs, target)``
``clip_grad_norm(options)``            the global gradient norm to clip to, or None (``[job] clip_grad_norm`` wins)
``blocks(model)``                      the model's repeated blocks, in order (hybrid layouts: sharding units,
                                       checkpointed blocks, pipeline stages; docs/hybrid.md)
``tp_plan(block)``                     one block's tensor-parallel plan: ``{submodule name: ColwiseParallel() |
                                       RowwiseParallel() ...}`` (``parallelize_module``'s); needed for ``tp > 1``
``pipeline_stage(model, first, last)``  the model cut to blocks ``first..last`` (with the input layers only if
                                       ``first`` is 0, the output layers only if ``last`` is the last block),
                                       taking and giving hidden states between stages; needed for ``pp > 1``
=====================================  ==========================================================

``inputs`` may be a tensor or a tuple of tensors; a tuple is passed to the model
as positional arguments. The built-in workloads live in the repository's
``models/`` folder (installed as :mod:`jabascli.builtin_models`) and are named
by their file stem: ``workload = "digits"``.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from jabascli.errors import InputError

if TYPE_CHECKING:
    from jabascli.config import LoadedConfig

REQUIRED = ("build_model", "train_dataset", "loss", "optimizer", "synthetic_batch")
OPTIONAL = (
    "val_dataset",
    "count_correct",
    "lr_scheduler",
    "collate",
    "clip_grad_norm",
    "blocks",
    "tp_plan",
    "pipeline_stage",
)


def builtin_folder() -> Path:
    import jabascli.builtin_models

    return Path(jabascli.builtin_models.__file__).parent


def builtin_workloads() -> dict[str, Path]:
    """Built-in workload names and their files."""
    return {p.stem: p for p in sorted(builtin_folder().glob("*.py")) if not p.stem.startswith("_")}


@dataclass
class Workload:
    """A loaded workload file, with the options its functions are called with."""

    name: str
    path: Path
    module: ModuleType
    options: dict[str, Any] = field(default_factory=dict)

    def build_model(self) -> Any:
        return self.module.build_model(self.options)

    def train_dataset(self) -> Any:
        return self.module.train_dataset(self.options)

    def val_dataset(self) -> Any | None:
        fn = getattr(self.module, "val_dataset", None)
        return None if fn is None else fn(self.options)

    def loss(self, output: Any, target: Any) -> Any:
        return self.module.loss(output, target)

    def optimizer(self, params: Any) -> Any:
        return self.module.optimizer(params, self.options)

    def lr_scheduler(self, optimizer: Any) -> Any | None:
        fn = getattr(self.module, "lr_scheduler", None)
        return None if fn is None else fn(optimizer, self.options)

    def synthetic_batch(self, batch_size: int) -> tuple[Any, Any]:
        return self.module.synthetic_batch(batch_size, self.options)

    def count_correct(self, output: Any, target: Any) -> int | None:
        fn = getattr(self.module, "count_correct", None)
        return None if fn is None else int(fn(output, target))

    def clip_grad_norm(self) -> float | None:
        fn = getattr(self.module, "clip_grad_norm", None)
        value = None if fn is None else fn(self.options)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise InputError.at(self.path, "clip_grad_norm", f"must return a number above 0 or None, got {value!r}")
        return None if value is None else float(value)

    def blocks(self, model: Any) -> list[Any] | None:
        """The model's blocks for hybrid layouts, or None when the workload declares none."""
        fn = getattr(self.module, "blocks", None)
        if fn is None:
            return None
        found = list(fn(model))
        if not found:
            raise InputError.at(self.path, "blocks", "returned no blocks")
        return found

    def tp_plan(self, block: Any) -> dict[str, Any] | None:
        """One block's tensor-parallel plan, or None when the workload declares none."""
        fn = getattr(self.module, "tp_plan", None)
        return None if fn is None else dict(fn(block))

    def pipeline_stage(self, model: Any, first: int, last: int) -> Any:
        """``model`` cut to the blocks ``first..last`` (the workload's ``pipeline_stage``)."""
        return self.module.pipeline_stage(model, first, last)

    @property
    def collate(self) -> Any | None:
        return getattr(self.module, "collate", None)


def resolve_workload_path(spec: str, config: Path | None = None) -> Path:
    """A workload file from a built-in name or a path; errors name ``config``'s ``job.workload``."""
    builtins = builtin_workloads()
    if spec in builtins:
        return builtins[spec]
    path = Path(spec)
    if path.suffix == ".py" or path.exists():
        if not path.is_file():
            raise InputError.at(path, None, "workload file not found")
        return path
    known = ", ".join(builtins) or "none"
    raise InputError.at(
        config, "job.workload", f"unknown workload {spec!r}: expected a built-in ({known}) or a .py file"
    )


def workload_of(loaded: LoadedConfig) -> Workload:
    """The job's workload (``[job] workload``, ``options`` and ``data``), imported and checked."""
    job = loaded.config.job
    return load_workload(job.workload, job.options, job.data, config=loaded.path)


def load_workload(
    spec: str | None, options: Mapping[str, Any] | None = None, data: Path | None = None, config: Path | None = None
) -> Workload:
    """Import a workload file and check it defines what jabas needs; errors about the spec name ``config``."""
    if spec is None:
        raise InputError.at(
            config, "job.workload", "no workload given: set [job] workload to a built-in name or a file"
        )
    path = resolve_workload_path(spec, config).resolve()
    module_name = f"jabas_workload_{path.stem}_{abs(hash(str(path)))}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None:
            raise InputError.at(path, None, "cannot be imported as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except SyntaxError as exc:
            del sys.modules[module_name]
            raise InputError.at(path, f"line {exc.lineno}", f"syntax error: {exc.msg}") from None
        except Exception as exc:
            del sys.modules[module_name]
            lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
            where = f"line {lines[-1]}" if lines else None  # the workload's own line that failed
            raise InputError.at(path, where, f"failed to import: {type(exc).__name__}: {exc}") from None
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise InputError.at(
            path, None, f"workload does not define {', '.join(missing)} (required: {', '.join(REQUIRED)})"
        )
    opts = {"data": data, **dict(options or {})}
    return Workload(getattr(module, "NAME", path.stem), path, module, opts)
