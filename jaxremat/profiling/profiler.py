"""From a :class:`~jaxremat.Chain` to the :class:`~jaxremat.ChainCosts` XLA will really use."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Callable

import jax

from jaxremat.core.costs import ChainCosts, StageOption
from jaxremat.core.policies import Policies, policies_of
from jaxremat.core.units import format_bytes
from jaxremat.model.chain import Chain
from jaxremat.model.identity import closure_key, stage_identity
from jaxremat.model.trees import is_sharded, mesh_devices, sharding_of, tree_bytes
from jaxremat.profiling import cache as disk_cache
from jaxremat.profiling.parallel import threads
from jaxremat.profiling.progress import progress
from jaxremat.profiling.rates import ESTIMATED, Rates, device_rates
from jaxremat.profiling.stage import StageProfile, profile_stage, with_times
from jaxremat.profiling.timing import TIMINGS, StageTimes

# Bump when what a measurement means changes, so that cached profiles from before are not reused.
# 31: a layer of a loop: its backwards' transients as a loop runs them. 30: a layer of a loop keeps
# what a scan over its copies stacks; a stage holding a loop holds
# nothing from constants (what each earlier version changed: git log -S PROFILE_VERSION)
PROFILE_VERSION = 31


def profile_stages(
    chain: Chain,
    variables: Any,
    sample: Any,
    *,
    method: str = "measure",
    rates: Rates | None = None,
    repeats: int = 5,
    cache: bool | None = None,
    quiet: bool = False,
    policies: Policies = None,
    loss: Callable[[Any], Any] | None = None,
) -> tuple[ChainCosts, list[StageProfile]]:
    """Profile every stage of ``chain`` on inputs shaped like ``sample``.

    ``x`` comes from the shapes, ``xbar`` from the bytes XLA keeps across an optimisation
    barrier between each stage's forward and backward, ``fwd_tmp`` / ``bwd_tmp`` from the
    compiled temp memory of the stage's forward and of its backward, times from the fastest of
    ``repeats`` interleaved wall-clock rounds (``"measure"``: the forward, the backward from
    its residuals, the two fused; every stage timed four times once all are compiled, a pass
    over the stages apart, the fastest kept) or from XLA's cost analysis against device rates
    (deterministic given ``rates``; measured once by :func:`measure_rates` when not given):
    ``"flops"`` the compiled flops at the flop rate, ``"xla"`` the roofline of flops and bytes
    accessed (:func:`~jaxremat.profiling.rates.estimated_time`). Each stage is also measured under every checkpoint
    policy of ``policies`` (its store options; by default ``dots_saveable`` and
    ``dots_with_no_batch_dims_saveable``, see :mod:`jaxremat.core.policies`; ``()`` for none),
    options no better than another of the same stage dropped, and as ``FB`` (its forward fused
    with its backward).

    ``loss``: the loss your training step applies to the chain's output (``loss(output) ->
    scalar``). XLA fuses it with the last stage's forward and backward, and the last stage's
    backward bytes are then measured with it (a GPT's LM head and mean-square loss: 1.5 MiB more
    than measured apart). Without it, the last stage is measured alone.

    Identical stages (same structure, variable shapes and input shapes) are measured once.
    Results are cached on disk (:mod:`jaxremat.cache`) unless ``cache=False`` or
    ``JAXREMAT_CACHE=0``; a progress bar shows on a terminal unless ``quiet``. Profiling uses its
    own RNG key and never changes ``variables``.

    Returns the costs and the per-stage measurements (flops and bytes accessed included).
    """
    if method not in ("measure", *ESTIMATED):
        raise ValueError(f"method must be 'measure', 'flops' or 'xla', got {method!r}")
    if method in ESTIMATED and rates is None:
        rates = device_rates(use_cache=cache)
    shapes = chain.shapes(variables, sample)
    per_stage = chain.split(variables)
    scanned = [chain.group_of(i) is not None for i in range(len(chain))]
    use_disk = disk_cache.enabled(cache)
    measured = policies_of(policies)
    policy_keys = [(name, closure_key(p)) for name, p in measured.items()]
    check_loss(loss)
    last = len(chain) - 1
    seen: dict[str, StageProfile] = {}  # identical stages are measured once
    timed: dict[str, StageTimes] = {}  # the stages measured here, to be timed once all are compiled
    keys: list[str] = []
    todo: dict[str, int] = {}  # a stage to measure per distinct key
    for i, (st, v) in enumerate(zip(chain.stages, per_stage)):
        key = disk_cache.make_key(
            "stage",
            PROFILE_VERSION,
            i == 0,
            scanned[i],
            stage_identity(st, v, shapes[i], costs=True),
            method,
            None if rates is None else dataclasses.asdict(rates),
            repeats if method == "measure" else 0,
            jax.default_backend(),
            jax.__version__,
            policy_keys,
            [str(sharding_of(leaf)) for leaf in jax.tree.leaves((v, shapes[i]))]
            if is_sharded((v, shapes[i]))
            else None,
            closure_key(loss) if i == last and loss is not None else None,
        )
        keys.append(key)
        if key in seen or key in todo:
            continue
        entry = disk_cache.load(key) if use_disk and st.key else None
        try:
            seen[key] = StageProfile.from_dict(entry) if entry is not None else None
        except TypeError:
            seen[key] = None
        if seen[key] is None:
            del seen[key]
            todo[key] = i

    def measure(i: int) -> tuple[StageProfile, StageTimes | None]:
        return profile_stage(
            chain.stages[i],
            per_stage[i],
            shapes[i],
            method=method,
            rates=rates,
            repeats=repeats,
            input_grad=i > 0,
            scanned=scanned[i],
            policies=measured,
            loss=loss if i == last else None,
        )

    # the distinct stages compiled side by side (:mod:`jaxremat.profiling.parallel`)
    with progress(len(todo), "profiling stages", quiet) as advance:
        with ThreadPoolExecutor(max_workers=threads()) as pool:
            running = {pool.submit(measure, i): key for key, i in todo.items()}
            for future in as_completed(running):
                key = running[future]
                prof, timer = future.result()
                if timer is not None:  # stored once timed
                    timed[key] = timer
                elif use_disk and chain.stages[todo[key]].key:
                    disk_cache.store(key, dataclasses.asdict(prof))
                seen[key] = prof
                advance(f"{len(set(keys))} distinct of {len(chain)}, {len(set(keys)) - len(todo)} from the cache")
    # Every stage measured here timed TIMINGS times once all are compiled, a pass over the stages
    # apart, each program's fastest time kept: a slow spell of the machine can outlast all the
    # rounds of one timing (right after a stage's compile most often), rarely all (StageTimes).
    with progress(TIMINGS * len(timed), "timing stages", quiet) as advance:
        for r in range(TIMINGS):
            for key, timer in timed.items():
                timed[key] = timer.timed(repeats)
                advance(f"{len(timed)} distinct stages, round {r + 1} of {TIMINGS}")
    cacheable = {k for k, st in zip(keys, chain.stages) if use_disk and st.key}
    for key, timer in timed.items():
        seen[key] = with_times(seen[key], timer)
        if key in cacheable:
            disk_cache.store(key, dataclasses.asdict(seen[key]))
    stages = [dataclasses.replace(seen[k], name=st.name, kind=st.kind) for k, st in zip(keys, chain.stages)]
    if loss is None:  # the loss reads the last stage's output, fused with it: no credit unmeasured
        # (a 2-block GPT's store-all step 1.034x its plan with it, 0.985x without)
        last_opts = tuple(dataclasses.replace(o, unread=0) for o in stages[-1].options)
        stages[-1] = dataclasses.replace(stages[-1], unread=0, options=last_opts)
    # ChainCosts field <- StageProfile field, per stage
    fields = dict(
        xbar="xbar",
        fwd="fwd_time",
        bwd="bwd_time",
        fwd_tmp="fwd_tmp",
        bwd_tmp="bwd_tmp",
        names="name",
        fwd_flops="fwd_flops",
        bwd_flops="bwd_flops",
        fwd_bytes="fwd_bytes",
        bwd_bytes="bwd_bytes",
        fb="fb_time",
        fb_flops="fb_flops",
        fb_tmp="fb_tmp",
        fb_reuse="fb_reuse",
        unread="unread",
    )
    costs = ChainCosts(
        x=[tree_bytes(s) for s in shapes],
        **{f: [getattr(p, g) for p in stages] for f, g in fields.items()},
        options=[useful_options(p) for p in stages] if measured else None,
        devices=mesh_devices((variables, sample)),
        held=[p.held for p in stages],
    )
    return costs, stages


def useful_options(p: StageProfile) -> tuple[StageOption, ...]:
    """A stage's measured store options without those no better than another of the stage (no
    less ``xbar``, ``bwd`` and ``bwd_tmp``, and no fewer backward flops where both are known;
    store-all is option 0 and always kept).

    Flops guard against timing noise: two policies' backwards that time within noise of each
    other (a GPT block's under ``dots_saveable`` and ``dots_with_no_batch_dims_saveable``) must
    not drop the one that recomputes less, or the schedule that stores every block under it
    (what ``jax.checkpoint(block, policy=dots_saveable)`` runs) is not one the solver can pick.
    """
    every = [StageOption("store_all", p.xbar, p.bwd_time, p.bwd_tmp, p.bwd_flops or None, p.unread)] + [
        StageOption(o.name, o.xbar, o.bwd_time, o.bwd_tmp, o.bwd_flops, o.unread) for o in p.options
    ]

    def no_more_flops(q: StageOption, o: StageOption) -> bool:
        return not q.bwd_flops or not o.bwd_flops or q.bwd_flops <= o.bwd_flops

    def beaten(k: int) -> bool:
        o = every[k]
        return any(
            q.xbar <= o.xbar
            and q.bwd <= o.bwd
            and q.bwd_tmp <= o.bwd_tmp
            and q.bwd_need <= o.bwd_need
            and no_more_flops(q, o)
            and (j < k or (q.xbar, q.bwd, q.bwd_need) != (o.xbar, o.bwd, o.bwd_need))
            for j, q in enumerate(every)
            if j != k
        )

    return tuple(o for k, o in enumerate(every) if k > 0 and not beaten(k))


def check_loss(loss: Any) -> None:
    """Refuse a ``loss=`` that is not a function (``None`` is: the last stage measured alone)."""
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a function of the model's output returning a scalar, got {type(loss).__name__}")


def profile(chain: Chain, variables: Any, sample: Any, **options: Any) -> ChainCosts:
    """The :class:`~jaxremat.ChainCosts` of ``chain``; ``options`` as for :func:`profile_stages`
    (``method``, ``rates``, ``repeats``, ``cache``, ``quiet``, ``policies``)."""
    return profile_stages(chain, variables, sample, **options)[0]


def report(stages: list[StageProfile]) -> str:
    """A table of the profile: per stage name, module type, output shape, sizes, temps and times."""
    head = (
        "stage",
        "type",
        "output",
        "x",
        "xbar",
        "fwd_tmp",
        "bwd_tmp",
        "fwd ms",
        "bwd ms",
        "FB ms",
        "FB tmp",
        "options: xbar / bwd ms",
    )
    rows = [
        (
            p.name,
            p.kind,
            p.out_shape,
            format_bytes(p.x_out),
            format_bytes(p.xbar),
            format_bytes(p.fwd_tmp),
            format_bytes(p.bwd_tmp),
            f"{1e3 * p.fwd_time:.3f}",
            f"{1e3 * p.bwd_time:.3f}",
            f"{1e3 * p.fb_time:.3f}",
            format_bytes(p.fb_tmp),
            "; ".join(f"{o.name} {format_bytes(o.xbar)} / {1e3 * o.bwd_time:.3f}" for o in p.options),
        )
        for p in stages
    ]
    widths = [max(len(str(r[k])) for r in [head, *rows]) for k in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    flags = [f"  {p.name}: {f}" for p in stages for f in p.flags]
    tail = ["", "measurements to doubt (timed again, still suspect):", *flags] if flags else []
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows] + tail)


__all__ = ["PROFILE_VERSION", "check_loss", "profile", "profile_stages", "report"]
