"""Options of the built-in workloads: variants, defaults and checks.

Every built-in workload is configured by its ``[job] options`` table. Each one
declares the options it understands (:class:`Spec`) and its variants, complete
sets of defaults such as ``resnet50`` or ``tiny``. :func:`resolve` starts from
the chosen variant, applies the user's options on top, and rejects unknown keys
and wrong types, naming the field (``job.options.<key>``), so a typo such as
``varient = "tiny"`` is an error instead of a silently full-size run.

This module is a helper, not a workload (the leading underscore keeps it out of
the built-in list); workload files import it by its package name,
``jabascli.builtin_models._options``, because they are loaded by path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jabascli.errors import InputError, Problem

FIELD = "job.options"


@dataclass(frozen=True)
class Spec:
    """One option: its type, what it means, and the values it may take."""

    kind: type
    help: str
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False
    """None is allowed (it means "decide from the data")."""


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def resolve(
    options: Mapping[str, Any] | None,
    specs: Mapping[str, Spec],
    variants: Mapping[str, Mapping[str, Any]],
    default_variant: str,
) -> SimpleNamespace:
    """The effective settings: the variant's defaults updated by ``options``.

    The result has one attribute per spec, plus ``variant`` and ``data`` (a
    :class:`~pathlib.Path` or None). Raises :class:`InputError` listing every
    unknown key, wrong type and out-of-range value at once.
    """
    given = dict(options or {})
    data = given.pop("data", None)
    variant = given.pop("variant", default_variant)
    problems: list[Problem] = []
    if not isinstance(variant, str) or variant not in variants:
        known = ", ".join(variants)
        problems.append(Problem(None, f"{FIELD}.variant", f"unknown variant {variant!r}: expected one of {known}"))
        variant = default_variant
    values = dict(variants[variant])
    for key, value in given.items():
        spec = specs.get(key)
        if spec is None:
            known = ", ".join(["variant", *sorted(specs)])
            problems.append(Problem(None, f"{FIELD}.{key}", f"unknown option (known: {known})"))
            continue
        message = _check(value, spec)
        if message:
            problems.append(Problem(None, f"{FIELD}.{key}", message))
        else:
            values[key] = float(value) if spec.kind is float else value
    if problems:
        raise InputError(problems)
    return SimpleNamespace(variant=variant, data=None if data is None else Path(data), **values)


def _check(value: Any, spec: Spec) -> str | None:
    if value is None:
        return None if spec.optional else f"expected {_KIND_NAMES[spec.kind]}, got nothing"
    is_bool = isinstance(value, bool)
    if spec.kind is float:
        ok = isinstance(value, int | float) and not is_bool
    elif spec.kind is int:
        ok = isinstance(value, int) and not is_bool
    else:
        ok = isinstance(value, spec.kind)
    if not ok:
        return f"expected {_KIND_NAMES[spec.kind]}, got {value!r}"
    if spec.choices and value not in spec.choices:
        return f"expected one of {', '.join(spec.choices)}, got {value!r}"
    if spec.minimum is not None and value < spec.minimum:
        return f"must be at least {spec.minimum:g}, got {value!r}"
    return None
