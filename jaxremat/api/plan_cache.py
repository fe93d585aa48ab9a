"""Verified plans kept on disk, so that a new process with the same function, shapes, budget
and options gets its plan without profiling, solving or compiling again.

A :func:`jaxremat.remat` plan's first call traces the function, profiles its stages (each kept in
the stage cache, :mod:`jaxremat.profiling.cache`), solves and verifies by compiling the step: the
verification's compiles alone took 68 s of an equinox transformer's 227 s first call on the CPU.
The stage cache saved the profile in a new process, not the compiles. The plan it ends with (or
its refusal, :class:`Refusal`) is kept here, keyed by what it was made from:

* the traced function: its jaxpr as text (every equation, its parameters without memory
  addresses, every shape and dtype; the same in every process), the layout of its inputs and
  which of them are static;
* the budget, the planning options (policies and a loss by their code and closed-over values),
  how it was cut (``stages``, ``max_stages``, ``user_remat``);
* the versions that change what a plan means: the profile's, the plan file's, jax's, the backend
  and the compile options the step is compiled with.

An entry of another version, a corrupt one or one that does not load is ignored (planned again),
never an error. ``cache=False`` (or ``JAXREMAT_CACHE=0``) turns it off with the stage cache;
``JAXREMAT_CACHE_DIR`` moves both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, NamedTuple

import jax

from jaxremat.api.plans import VERSION, Plan, PlanOptions, plan_from_json
from jaxremat.core.compile import compiler_options
from jaxremat.core.device import Device
from jaxremat.core.schedule import InfeasibleBudget
from jaxremat.model.identity import closure_key
from jaxremat.model.jaxpr_eval import jaxpr_text
from jaxremat.profiling import cache as disk_cache
from jaxremat.profiling.profiler import PROFILE_VERSION


def _options_key(o: PlanOptions) -> list:
    policies = o.policies
    if isinstance(policies, dict):
        policies = sorted((name, closure_key(p)) for name, p in policies.items())
    profile = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in o.profile_options.items()}
    profile.pop("quiet", None)  # how it is shown, not what it is
    profile.pop("cache", None)
    return [
        o.algorithm,
        o.method,
        o.slots,
        o.max_period,
        repr(policies),
        repr(o.bandwidth),
        o.verify,
        None if o.loss is None else closure_key(o.loss),
        sorted(profile.items()),
    ]


def _budget_key(budget: Any) -> Any:
    """A budget as a key: a :class:`~jaxremat.Device` by its size, headroom and optimizer (by its
    functions' code and closed-over values: an Adam's learning rate is not its state's size, but
    two optimizers of one class may hold different state)."""
    if not isinstance(budget, Device):
        return repr(budget)
    opt = budget.optimizer
    optimizer = None if opt is None else [closure_key(opt.init), closure_key(opt.update)]
    return ["Device", budget.limit(), budget.headroom, optimizer]


def plan_key(closed: Any, inputs: str, budget: Any, options: PlanOptions, cut: tuple) -> str:
    """The key of a plan for the traced function ``closed`` (``inputs``: its input signature as
    :class:`~jaxremat.RematFunction` keys it), ``budget``, ``options`` and ``cut`` (``stages``,
    ``max_stages``, ``user_remat``)."""
    text = hashlib.sha256(jaxpr_text(closed).encode()).hexdigest()
    return disk_cache.make_key(
        "plan",
        VERSION,
        PROFILE_VERSION,
        text,
        inputs,
        _budget_key(budget),
        _options_key(options),
        [repr(c) for c in cut],
        jax.__version__,
        jax.default_backend(),
        sorted(compiler_options().items()),
        os.environ.get("XLA_FLAGS", ""),
    )


def enabled(options: PlanOptions) -> bool:
    return disk_cache.enabled(options.profile_options.get("cache"))


def load(key: str) -> Plan | Refusal | None:
    """The plan (or the refusal) kept under ``key``, or ``None`` (none, or one that does not load)."""
    entry = disk_cache.load(key)
    if entry is None:
        return None
    try:
        if isinstance(entry, dict) and "refusal" in entry:
            r = entry["refusal"]
            return Refusal(str(r["signature"]), InfeasibleBudget(*r["error"]))
        return plan_from_json(entry)
    except (ValueError, KeyError, TypeError):
        return None


class Refusal(NamedTuple):
    """A budget refused for a function (by the solver, or by XLA's measure of the schedules that
    verification compiled), kept so that a new process refuses it without the compiles: a linen
    CNN's 50%, refused by measurement, took 4 s of verification in every process."""

    signature: str
    error: InfeasibleBudget


def store(key: str, entry: Plan | Refusal) -> None:
    if isinstance(entry, Refusal):
        e = entry.error
        disk_cache.store(key, {"refusal": {"signature": entry.signature,
                                           "error": [e.algorithm, e.budget, e.min_budget, e.note]}})
    else:
        disk_cache.store(key, entry.to_json())


__all__ = ["Refusal", "enabled", "load", "plan_key", "store"]
