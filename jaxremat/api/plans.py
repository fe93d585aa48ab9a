"""A plan: the costs, the schedule and what they were made for, saved and loaded as JSON."""

from __future__ import annotations

import functools
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import jax

from jaxremat.api import _loop_plans
from jaxremat.api.calibrate import calibrated_solve, compile_schedule_step, step_temp
from jaxremat.api.verify import HandCheck, Measured, Verification, verify
from jaxremat.core.budgets import Budget, parse_budget
from jaxremat.core.costs import ChainCosts
from jaxremat.core.loops import MAX_PERIOD
from jaxremat.core.policies import Policies, Policy, policies_of
from jaxremat.core.schedule import Block, Schedule
from jaxremat.core.transfers import Bandwidth, BandwidthLike
from jaxremat.model.chain import Chain
from jaxremat.model.identity import leaf_signature, stage_identity
from jaxremat.profiling.bandwidth import link_bandwidth
from jaxremat.profiling.profiler import check_loss, profile
from jaxremat.profiling.rates import ESTIMATED
from jaxremat.run.executor import execute
from jaxremat.solvers import OFFLOAD_ALGORITHMS, canonical, solve

FORMAT = "jaxremat-plan"
# the plan file's format: read at this version only (nothing has been released; a plan of another
# version is made again). 8: the user's blocks (Schedule.blocks), the budget as asked (Schedule.asked)
VERSION = 8
READS = (VERSION,)


def option_names() -> tuple[str, ...]:
    """The planning options a user may pass (:class:`PlanOptions`' fields): the one list every
    entry point checks keywords against and names in its errors."""
    return tuple(f.name for f in dataclasses.fields(PlanOptions) if f.name != "profile_options")


def signature(chain: Chain, variables: Any, sample: Any) -> str:
    """What a plan depends on: each stage's identity (structure, variable shapes and dtypes) and
    the input's shapes and dtypes."""
    ids = [stage_identity(st, v) for st, v in zip(chain.stages, chain.stage_shapes(variables))]
    return json.dumps([ids, leaf_signature(sample)])


@dataclass(frozen=True)
class PlanOptions:
    """How to plan, shared by :func:`plan`, :func:`~jaxremat.remat_chain` and
    :func:`~jaxremat.remat_nnx`.

    Attributes:
      algorithm: a solver algorithm (``"optimal"``, ``"revolve"``, ...; see ``jaxremat.ALGORITHMS``).
      method: how stages are profiled: ``"measure"`` (wall clock), ``"flops"`` (compiled flops at
        the device's flop rate, as verification ranks schedules) or ``"xla"`` (roofline).
      slots: memory discretisation of the DP.
      calibrate: correct the plan with XLA's measured memory (a few compilations).
      max_period: the longest pattern repeated over a :class:`~jaxremat.Repeat` layer
        (1 keeps to loops that compile one block body).
      policies: the checkpoint policies measured as store options of every stage
        (:data:`jaxremat.core.policies.Policies`: ``None`` for ``dots_saveable`` and
        ``dots_with_no_batch_dims_saveable``, a dict ``{name: policy}`` to add yours, ``()`` for none).
      bandwidth: for ``algorithm="optimal_offload"``: bytes per second of the device-to-host and
        host-to-device links (one number or a pair); ``None`` measures them on a GPU (once,
        cached) and is an error on the CPU, where nothing moves.
      loss: the loss your step applies to the model's output (``loss(output) -> scalar``); the
        last stage is then profiled fused with it, as XLA runs it (:func:`jaxremat.profile`).
      verify: compile the step under the plan before it is used and read XLA's memory; over the
        budget, correct and plan again until it fits (:mod:`jaxremat.api.verify`). ``False``
        trusts the cost model (no extra compiles). ``None``: the entry point's default, on for
        :func:`~jaxremat.remat`, off for ``remat_chain``, ``remat_nnx`` and :func:`~jaxremat.plan`
        (whose built-in models meet their plans; ``calibrate=True`` measures them).
    """

    algorithm: str = "optimal"
    method: str = "measure"
    slots: int = 500
    calibrate: bool = False
    max_period: int = MAX_PERIOD
    policies: Policies = None
    bandwidth: BandwidthLike | None = None
    verify: bool | None = None
    loss: Callable[[Any], Any] | None = field(default=None, compare=False)
    profile_options: dict = field(default_factory=dict, compare=False)

    @property
    def named_policies(self) -> dict[str, Policy] | None:
        """The policies given by name (what the executor needs beyond the built-in ones)."""
        return dict(self.policies) if isinstance(self.policies, Mapping) else None

    def __post_init__(self) -> None:
        name = canonical(self.algorithm)  # unknown names fail now, not at the first call
        if self.bandwidth is not None:
            if name not in OFFLOAD_ALGORITHMS:
                raise ValueError(
                    f"bandwidth is for algorithm='optimal_offload'; algorithm={self.algorithm!r} moves nothing to "
                    "host memory"
                )
            Bandwidth.of(self.bandwidth)
        if name in OFFLOAD_ALGORITHMS and self.bandwidth is None and jax.default_backend() == "cpu":
            raise ValueError(
                f"algorithm={self.algorithm!r} needs bandwidth= on the CPU: host and device memory are one here and "
                "offloading moves nothing, so there is no link to measure; give bytes per second (one number, or "
                "(to_host, to_device)) to plan as for an accelerator"
            )
        if self.calibrate and name in OFFLOAD_ALGORITHMS:
            raise ValueError(
                "calibrate=True measures memory on this machine; it does not plan offloading yet: "
                "calibrate a remat-only plan, or leave calibrate out"
            )
        if self.verify is not None and not isinstance(self.verify, bool):
            raise ValueError(f"verify must be True, False or None (the default), got {self.verify!r}")
        if self.method not in ("measure", *ESTIMATED):
            raise ValueError(f"method must be 'measure', 'flops' or 'xla', got {self.method!r}")
        if isinstance(self.max_period, bool) or not isinstance(self.max_period, int) or self.max_period < 1:
            raise ValueError(f"max_period must be an int >= 1, got {self.max_period!r}")
        policies_of(self.policies)  # bad policies fail now
        check_loss(self.loss)


@dataclass(frozen=True)
class SetupTime:
    """Where a plan's first call spent its seconds: tracing the function and cutting it into
    stages, profiling them (0 when the costs were cached), solving, and verifying by XLA;
    ``cached``: the plan was read from the disk cache (:mod:`jaxremat.api.plan_cache`)."""

    trace: float
    profile: float
    plan: float
    verification: float
    cached: bool = False

    @property
    def total(self) -> float:
        return self.trace + self.profile + self.plan + self.verification

    def line(self) -> str:
        return (
            f"  setup {self.total:.1f} s: trace {self.trace:.1f}, profile {self.profile:.1f}, "
            f"plan {self.plan:.1f}, verification {self.verification:.1f}"
            + ("; the plan read from the disk cache" if self.cached else "")
        )


@dataclass(frozen=True)
class Plan:
    """The schedule a wrapped model runs, with the costs it was solved on."""

    schedule: Schedule
    signature: str
    verification: Verification | None = field(default=None, compare=False)
    setup: SetupTime | None = field(default=None, compare=False)

    @property
    def costs(self) -> ChainCosts:
        return self.schedule.costs

    @property
    def predicted_peak(self) -> int:
        """Predicted peak bytes of activations (``a_0`` included, parameters not)."""
        return self.schedule.peak

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over the store-all time."""
        return self.schedule.overhead

    @property
    def measured_peak(self) -> int | None:
        """XLA's peak of the step under this plan, as :meth:`predicted_peak` counts it (``None``
        for a plan not verified)."""
        return None if self.verification is None else self.verification.measured_peak

    def report(self) -> str:
        lines = [self.schedule.summary()]
        if self.verification is not None:
            lines += self.verification.lines()
        if self.setup is not None:
            lines.append(self.setup.line())
        return "\n".join(lines)

    def check(self, chain: Chain, variables: Any, sample: Any) -> None:
        """``ValueError`` unless this plan was made for this chain, variables and input shape."""
        if signature(chain, variables, sample) != self.signature:
            raise ValueError(
                "this plan was made for another model or input shape (stage structure, variable "
                "shapes or input shape differ); make a new one with jaxremat.plan(...)"
            )

    def executor(
        self, chain: Chain, variables: Any, sample: Any, policies: Mapping[str, Policy] | None = None
    ) -> Callable[..., tuple[Any, Any]]:
        """:func:`~jaxremat.execute` of this plan, after checking it fits the model."""
        self.check(chain, variables, sample)
        return execute(chain, self.schedule, policies=policies)

    def to_json(self) -> dict:
        s = self.schedule
        return {
            "format": FORMAT,
            "version": VERSION,
            "signature": self.signature,
            "costs": s.costs.to_dict(),
            "budget": s.budget,
            "algorithm": s.algorithm,
            "ops": [[op.kind.value, *op[1:]] for op in s.ops],
            "bandwidth": None if s.bandwidth is None else [s.bandwidth.to_host, s.bandwidth.to_device],
            "blocks": [[b.start, b.stop, b.policy] for b in s.blocks],
            "asked": s.asked,
            "note": s.note,
            "verification": None if self.verification is None else dataclasses.asdict(self.verification),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


def load_plan(path: str | Path) -> Plan:
    """A plan saved with :meth:`Plan.save`; its ops are replayed to check them."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a jaxremat plan from {path}: {e}") from None
    return plan_from_json(d, str(path))


def plan_from_json(d: Any, path: str = "the plan") -> Plan:
    """The inverse of :meth:`Plan.to_json` (``ValueError`` naming ``path`` for anything else)."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise ValueError(f"{path} is not a jaxremat plan")
    if d.get("version") not in READS:
        raise ValueError(
            f"{path} is a version {d.get('version')} plan; this jaxremat reads versions {', '.join(map(str, READS))}: "
            "make it again with jaxremat.plan(...).save(path)"
        )
    costs = ChainCosts.from_dict(d["costs"])
    schedule = Schedule.from_ops(
        costs,
        [tuple(op) for op in d["ops"]],
        budget=d["budget"],
        algorithm=d["algorithm"],
        bandwidth=d.get("bandwidth"),
        blocks=tuple(Block(int(b), int(e), str(p)) for b, e, p in d["blocks"]),
    )
    found = d.get("verification")
    if found is not None:
        found = Verification(**{**found, "hand": tuple(HandCheck(**h) for h in found.get("hand", ()))})
    schedule = dataclasses.replace(schedule, asked=str(d["asked"]), note=str(d.get("note", "")))
    return Plan(schedule, d["signature"], found)


def make_plan(
    chain: Chain,
    variables: Any,
    sample: Any,
    budget: Budget,
    options: PlanOptions,
    costs: ChainCosts | None = None,
    *,
    verified: bool = True,
) -> Plan:
    """Profile ``chain`` (unless ``costs`` are given) and solve for ``budget`` under ``options``
    (what :func:`jaxremat.plan` does for a :class:`~jaxremat.Chain`). With ``options.verify``
    (and ``verified``: the caller verifies itself when ``False``), a remat plan is compiled and
    checked by XLA before it is returned (:func:`~jaxremat.api.verify.verify`); ``Repeat``
    loops, offloading (which the CPU cannot measure) and ``calibrate=True`` (measured already)
    are not."""
    if costs is None:
        costs = profile(
            chain,
            variables,
            sample,
            method=options.method,
            policies=options.policies,
            loss=options.loss,
            **options.profile_options,
        )
    o = options
    asked = _loop_plans.describe_loop_budget(chain, variables, costs, budget) if chain.stacked else None
    if chain.stacked and canonical(o.algorithm) == "optimal":
        schedule = None
        if o.calibrate:
            schedule = _loop_plans.calibrated_loop_schedule(
                chain, variables, sample, costs, budget, o.max_period, o.named_policies
            )
        if schedule is None:
            schedule = _loop_plans.loop_schedule(chain, variables, costs, budget, o.slots, o.max_period)
    else:
        if chain.stacked:  # other algorithms: the schedule as solved, each Repeat's stacked gradient held
            costs, budget = _loop_plans.with_stacked_gradients(chain, variables, costs, budget)
        if o.calibrate:
            measure = functools.partial(step_temp, chain, variables, sample, policies=o.named_policies)
            schedule = calibrated_solve(costs, budget, measure, algorithm=o.algorithm, slots=o.slots).schedule
        elif canonical(o.algorithm) in OFFLOAD_ALGORITHMS:
            bandwidth = o.bandwidth if o.bandwidth is not None else link_bandwidth()
            schedule = solve(costs, budget, algorithm=o.algorithm, slots=o.slots, bandwidth=bandwidth)
        else:
            schedule = solve(costs, budget, algorithm=o.algorithm, slots=o.slots)
            if o.verify and verified:
                target = None if budget is None else parse_budget(budget, costs)
                schedule, found = verify(
                    costs,
                    target,
                    schedule,
                    chain_measure(chain, variables, sample, o.named_policies),
                    algorithm=o.algorithm,
                    slots=o.slots,
                )
                return Plan(schedule, signature(chain, variables, sample), found)
    if asked is not None:  # a share of the loop store-all peak, not of the chain's
        schedule = dataclasses.replace(schedule, asked=asked)
    return Plan(schedule, signature(chain, variables, sample))


def chain_measure(chain: Chain, variables: Any, sample: Any, policies: Any = None) -> Callable[[Schedule], Measured]:
    """``measure(schedule)`` for :func:`~jaxremat.api.verify.verify`: the update step of
    ``chain`` under the schedule (:func:`~jaxremat.api.calibrate.compile_schedule_step`), its
    temp plus the input ``a_0`` (an argument of the step, which the plan counts)."""

    def measure(schedule: Schedule) -> Measured:
        compiled = compile_schedule_step(chain, variables, sample, schedule, policies)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        return Measured(temp + int(schedule.costs.x[0]), float((cost or {}).get("flops", 0.0)))

    return measure


__all__ = [
    "FORMAT",
    "READS",
    "plan_from_json",
    "VERSION",
    "Plan",
    "PlanOptions",
    "SetupTime",
    "load_plan",
    "make_plan",
    "option_names",
    "signature",
]
