"""The ``jaxremat`` command line: ``plan``, ``bench``, ``fit`` and ``demo``.

Models are named either by a built-in name (``resnet``, ``gpt``, ``autoencoder``, ``mixer``; see
:mod:`jaxremat.models`) or by ``PKG.MODULE:FACTORY``, where ``FACTORY`` is a Flax model (an
``nn.Sequential``, a list of linen modules, an ``nnx.Sequential``) or a function of no arguments
returning one. User mistakes end with a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, Sequence

from jaxremat.tools.models import SAMPLES


class UsageError(ValueError):
    """A mistake in the command line, reported in one line."""


# -- loading a model ------------------------------------------------------------------------------


def load_model(spec: str, strategies: bool = False) -> tuple[Any, tuple[int, ...] | None, str]:
    """``(model, default input shape or None, default dtype)`` for a built-in name or
    ``PKG.MODULE:FACTORY``; with ``strategies`` (``fit``), the factory may also give a dict of
    :data:`~jaxremat.tools.fit.Strategy` by name, ``"no remat"`` among them."""
    if spec in SAMPLES:
        factory, shape, dtype = SAMPLES[spec]
        return factory(), shape, dtype
    if ":" not in spec:
        raise UsageError(
            f"cannot find model {spec!r}: give a built-in model ({', '.join(SAMPLES)}) or PKG.MODULE:FACTORY"
        )
    module_name, _, attr = spec.partition(":")
    sys.path.insert(0, str(Path.cwd()))  # like python -m: modules in the current folder are found
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"cannot import {module_name!r} (from --model {spec}): {e}") from None
    finally:
        sys.path.pop(0)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"module {module_name!r} has no attribute {attr!r} (from --model {spec})")
        obj = getattr(obj, part)
    if isinstance(obj, type) or (callable(obj) and not _is_model(obj)):
        try:
            obj = obj()
        except TypeError as e:
            raise UsageError(f"{spec} must be a model or a function of no arguments returning one: {e}") from None
    if strategies and isinstance(obj, dict):
        if "no remat" not in obj or not all(callable(make) for make in obj.values()):
            raise UsageError(
                f"{spec} gave a dict; for fit it must map strategy names, 'no remat' among them, to functions "
                f"make(size) -> (loss, args) (got keys {sorted(obj)})"
            )
        return obj, None, "float32"
    if not _is_model(obj):
        raise UsageError(
            f"{spec} gave a {type(obj).__name__}; expected a linen module (any: a Sequential is planned layer by "
            "layer, another is cut from its jaxpr as jaxremat.remat does), a list of linen modules or an nnx.Sequential"
        )
    return obj, None, "float32"


def _is_model(obj: Any) -> bool:
    import flax.linen as nn
    from flax import nnx

    return isinstance(obj, (nn.Module, nnx.Sequential)) or (
        isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(m, (nn.Module, nnx.Module)) for m in obj)
    )


def parse_shape(text: str) -> tuple[int, ...]:
    """``"16,32,32,3"`` (or ``16x32x32x3``) -> ``(16, 32, 32, 3)``."""
    parts = text.replace("x", ",").replace(" ", "").strip("()[]").split(",")
    try:
        shape = tuple(int(p) for p in parts if p)
    except ValueError:
        raise UsageError(f"cannot read an input shape from {text!r}; write it as e.g. 16,32,32,3") from None
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"input shape {text!r} must be positive integers, e.g. 16,32,32,3")
    return shape


def prepare(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """``(model, chain, variables, sample input)`` from ``--model``, ``--input-shape``, ``--dtype``."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxremat.model.chain import Chain
    from jaxremat.tools.models import sample_input

    model, shape, dtype = load_model(args.model)
    if args.input_shape:
        shape = parse_shape(args.input_shape)
    if shape is None:
        raise UsageError(f"--input-shape is needed for {args.model} (e.g. --input-shape 16,32,32,3)")
    dtype = args.dtype or dtype
    try:
        np.dtype(dtype)
    except TypeError:
        raise UsageError(f"unknown --dtype {dtype!r}; use e.g. float32, bfloat16 or int32") from None
    x = sample_input(shape, dtype)
    if _is_linen_function_model(model):
        return _jaxpr_chain(args, model, x, shape, dtype)
    nnx_model = isinstance(model, nnx.Sequential) or (
        isinstance(model, (list, tuple)) and isinstance(model[0], nnx.Module)
    )
    chain = Chain.from_nnx(model) if nnx_model else Chain.from_linen(model)
    try:
        variables = (
            chain.init(jax.random.key(0), x) if nnx_model or not chain.sequential else model.init(jax.random.key(0), x)
        )
    except Exception as e:  # noqa: BLE001 - the model cannot take this input
        raise UsageError(
            f"{args.model} cannot take an input of shape {shape} ({dtype}): {type(e).__name__}: "
            f"{str(e).splitlines()[0]}"
        ) from None
    chain.shapes(variables, x)  # names the stage that cannot take its input
    return model, chain, variables, x


def _is_linen_function_model(model: Any) -> bool:
    import flax.linen as nn

    return isinstance(model, nn.Module) and not isinstance(model, nn.Sequential)


def _jaxpr_chain(args: argparse.Namespace, model: Any, x: Any, shape: tuple, dtype: str) -> tuple[Any, Any, Any, Any]:
    """A linen model that is not a Sequential, cut from its training loss's jaxpr (as ``jaxremat.remat``)."""
    import jax
    import jax.numpy as jnp

    from jaxremat.model.jaxpr_chain import JaxprChain, trace

    try:
        variables = model.init(jax.random.key(0), x)
    except Exception as e:  # noqa: BLE001 - the model cannot take this input
        raise UsageError(
            f"{args.model} cannot take an input of shape {shape} ({dtype}): {type(e).__name__}: "
            f"{str(e).splitlines()[0]}"
        ) from None

    def loss(v: Any, x: Any) -> Any:
        return jnp.mean(jnp.square(model.apply(v, x)).astype(jnp.float32))

    closed, _, _ = trace(loss, (variables, x))
    traced = JaxprChain.of(closed)
    print(f"{args.model}: {traced.cuts.count} stages cut by {traced.cuts.how}")
    return model, traced.chain, traced.variables(jax.tree.leaves((variables, x))), ()


# -- commands --------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> None:
    from jaxremat.api.planner import plan
    from jaxremat.core.budgets import parse_budget
    from jaxremat.core.schedule import InfeasibleBudget
    from jaxremat.core.units import format_bytes
    from jaxremat.profiling.profiler import profile_stages, report
    from jaxremat.solvers import ALGORITHMS, solve

    _, chain, variables, x = prepare(args)
    costs, stages = profile_stages(chain, variables, x, method=args.method, quiet=args.quiet)
    budget = parse_budget(args.budget, costs)
    print(report(stages), "\n")
    schedule = solve(costs, budget, algorithm=args.algorithm, bandwidth=args.bandwidth)
    print(schedule.summary(), "\n")
    print(f"{'algorithm':<14} {'predicted peak':>15} {'time over store-all':>20}")
    for algorithm in ALGORITHMS:  # registered names only (aliases are not listed)
        try:
            s = solve(costs, budget, algorithm=algorithm)
            print(f"{algorithm:<14} {format_bytes(s.peak):>15} {s.overhead:>19.3f}x")
        except InfeasibleBudget as e:
            print(f"{algorithm:<14} {'does not fit':>15} {'least ' + format_bytes(e.min_budget):>20}")
    if args.save:
        plan(chain, variables, x, budget, algorithm=args.algorithm, bandwidth=args.bandwidth, costs=costs).save(
            args.save
        )
        print(f"\nplan saved to {args.save}")
    if args.plot:
        from jaxremat.tools.plots import plot_front

        print(f"Pareto front written to {plot_front(costs, args.plot)}")


def cmd_bench(args: argparse.Namespace) -> None:
    from jaxremat.tools import bench

    model, chain, variables, x = prepare(args)
    out = Path(args.out)
    name = args.model.replace(":", "_").replace(".", "_")
    _, md = bench.run(
        args.model,
        chain,
        x,
        out,
        name=name,
        method=args.method,
        rounds=args.rounds,
        quiet=args.quiet,
        plot=not args.no_plot,
        variables=variables,
        points=args.points,
        manual=args.manual,
    )
    (out / f"{name}.md").write_text(md)
    print(md)
    print(f"results written under {out}/")


def cmd_fit(args: argparse.Namespace) -> None:
    from jaxremat.core.device import Device
    from jaxremat.tools.fit import fit, model_strategies, write_json

    model, shape, dtype = load_model(args.model, strategies=True)
    shape = parse_shape(args.input_shape) if args.input_shape else shape
    given = isinstance(model, dict)  # the user's strategies make their inputs: the axis is a label
    if shape is None and not given:
        raise UsageError(f"--input-shape is needed for {args.model} (e.g. --input-shape 16,32,32,3)")
    axes = {"batch": 0, "sequence": 1}
    axis = axes.get(args.axis, int(args.axis) if args.axis.isdigit() else -1)
    if not given and not 0 <= axis < len(shape):
        raise UsageError(f"--axis {args.axis!r}: give batch, sequence or a dimension of the input (0-{len(shape) - 1})")
    lo, _, hi = args.range.partition(":")
    if not (lo.isdigit() and hi.isdigit()):
        raise UsageError(f"--range {args.range!r}: give the smallest and largest sizes as LO:HI, e.g. 8:1024")
    device = Device(args.memory, headroom=args.headroom)
    strategies = model if given else model_strategies(model, shape, args.dtype or dtype, axis)
    result = fit(strategies, device, sizes=(int(lo), int(hi)), model=args.model, axis=args.axis,
                 steps=args.steps, time_all=args.curve, quiet=args.quiet)
    print(f"{args.model}: the largest {args.axis} in {device.describe()} ({result.usable:,} bytes usable)\n")
    print(result.table())
    if args.json:
        write_json(result, args.json)
        print(f"\nwritten to {args.json}")
    if args.plot:
        from jaxremat.tools.plots import plot_fit

        print(f"plot written to {plot_fit(result, args.plot)}")


def cmd_demo(args: argparse.Namespace) -> None:
    from jaxremat.tools.demo import run_demo

    model, chain, variables, x = prepare(args)
    run_demo(
        args.model,
        model,
        chain,
        variables,
        x,
        args.budget,
        steps=args.steps,
        method=args.method,
        quiet=args.quiet,
        calibrate=args.calibrate,
    )


# -- the parser ------------------------------------------------------------------------------------


def _model_args(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument(
        "--model",
        default=default,
        required=default is None,
        help=f"built-in ({', '.join(SAMPLES)}) or PKG.MODULE:FACTORY" + (f" (default {default})" if default else ""),
    )
    p.add_argument("--input-shape", help="input shape, e.g. 16,32,32,3 (built-in models have one)")
    p.add_argument("--dtype", help="input dtype (default float32; the built-in gpt takes int32)")
    p.add_argument(
        "--method",
        choices=("measure", "flops", "xla"),
        default="measure",
        help="profile by timing each stage, or from XLA's cost analysis: flops, or the roofline of flops "
        "and bytes (xla) (default measure)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="jaxremat", description="Optimal rematerialisation for JAX under a memory budget."
    )
    sub = top.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "plan",
        help="profile a model, solve for a budget, print the schedule",
        description="Profile a model, solve for a budget and print the schedule with its predicted "
        "memory and time against the other algorithms.",
    )
    _model_args(p, None)
    p.add_argument("--budget", required=True, help="bytes, '512MiB', '2GB' or a share of the store-all peak ('40%%')")
    p.add_argument(
        "--algorithm",
        default="optimal",
        help="optimal (default), revolve, sqrt, every_stage, ..., or optimal_offload (with --bandwidth)",
    )
    p.add_argument("--bandwidth", type=float, help="for optimal_offload: host link bytes per second, each way")
    p.add_argument("--plot", metavar="FILE.png", help="also write the predicted time-memory front")
    p.add_argument("--save", metavar="PLAN.json", help="save the plan for jaxremat.load_plan")
    p.set_defaults(run=cmd_plan)

    b = sub.add_parser(
        "bench",
        help="measure jaxremat against hand-written jax.checkpoint strategies",
        description="Compile and time the model's training step under each hand-written "
        "jax.checkpoint strategy and under jaxremat for a sweep of budgets (CSV, markdown, plot).",
    )
    _model_args(b, None)
    b.add_argument(
        "--out", default="jaxremat-bench", help="folder for the CSV, markdown and PNG (default jaxremat-bench)"
    )
    b.add_argument("--rounds", type=int, default=6, help="timing rounds (each 5 calls per strategy; default 6)")
    b.add_argument("--points", type=int, default=8, help="budgets in jaxremat's sweep (default 8)")
    b.add_argument(
        "--manual",
        nargs="+",
        metavar="NAME",
        help="only these hand-written strategies (e.g. 'remat every block' 'policy dots_saveable'); default all",
    )
    b.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    b.set_defaults(run=cmd_bench)

    f = sub.add_parser(
        "fit",
        help="the largest batch (or other input size) that fits a device, per strategy, and its speed",
        description="Find, by bisection on XLA-measured compiles, the largest size of an input axis whose "
        "training step fits the memory under no remat, each hand-written jax.checkpoint strategy and "
        "jaxremat, and time each there.",
    )
    f.add_argument(
        "--model",
        required=True,
        help=f"built-in ({', '.join(SAMPLES)}) or PKG.MODULE:FACTORY, a model or a dict of the user's strategies: "
        "name -> make(size) -> (loss, args), 'no remat' among them",
    )
    f.add_argument("--memory", required=True, help="the device's memory: '16GiB', '24GB', bytes, or 'device' (GPU)")
    f.add_argument("--axis", default="batch", help="batch (default), sequence, or an input dimension's index")
    f.add_argument("--range", default="8:1024", help="smallest and largest sizes to try, LO:HI (default 8:1024)")
    f.add_argument("--headroom", type=float, default=0.05, help="share of the memory kept free (default 0.05)")
    f.add_argument("--input-shape", help="input shape at any size, e.g. 16,32,32,3 (built-in models have one)")
    f.add_argument("--dtype", help="input dtype (default float32; the built-in gpt takes int32)")
    f.add_argument("--steps", type=int, default=5, help="timed steps per strategy (default 5; 0: no timing)")
    f.add_argument("--curve", action="store_true", help="time every size tried that fits, not only the largest")
    f.add_argument("--json", metavar="FILE.json", help="also write the results as JSON")
    f.add_argument("--plot", metavar="FILE.png", help="also write memory and throughput against size")
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.set_defaults(run=cmd_fit)

    d = sub.add_parser(
        "demo",
        help="the main job: plan a real Flax model, train it under a budget, compare",
        description="Profile a Flax model, plan it for a budget, train a few optax steps under the "
        "plan, and print predicted against XLA-measured memory and time next to the usual "
        "jax.checkpoint strategies.",
    )
    _model_args(d, "resnet")
    d.add_argument("--budget", default="50%", help="bytes, '512MiB' or a share of the store-all peak (default 50%%)")
    d.add_argument("--steps", type=int, default=5, help="training steps to run under the plan (default 5)")
    d.add_argument(
        "--calibrate", action="store_true", help="correct the plan with XLA's measured memory (a few more compilations)"
    )
    d.set_defaults(run=cmd_demo)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from jaxremat.core.schedule import InfeasibleBudget

    try:
        args.run(args)
    except (UsageError, InfeasibleBudget) as e:
        print(f"jaxremat: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # bad budgets, models that are not chains, ...
        print(f"jaxremat: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
