"""What the first call of ``jaxremat.remat`` costs, against the plain step's compile.

For each model, in a fresh process: the plain training step (gradient of the first argument,
Adam, donated, as ``tests/outside_models.update_step`` compiles it) is compiled and timed; then
``jaxremat.remat(loss, "50%", method=METHOD)``'s first call (``"75%"`` where 50% is refused, the
refusal's time counted): tracing, profiling, solving,
verifying (the split its plan reports) and the compile of the planned step, which is what the
user waits for before the first step runs. The same again in a second process with the same
cache folder (``JAXREMAT_CACHE_DIR``): the verified plan is read from the disk
(:mod:`jaxremat.api.plan_cache`), and only the trace and the planned step's compile remain. Each
ratio is the median of several processes (``FIRST_RUNS``, ``SECOND_RUNS``), each to its own plain
compile.

Goal (issue 44): the first call at most 5x the plain compile (or the plain compile + 10 s,
whichever is more), the second process at most 1.5x.

    python benchmarks/setup_time.py [model ...]

Models: the outside corpus (``tests/outside_models.py``: the linen decoder looping over its 8
blocks, the loop MLP, the linen CNN with BatchNorm, dropout and the user's ``nn.remat``, the
equinox transformer with its blocks in a list, the NNX list), the built-in ResNet and GPT (a
Python loop over their blocks, planned through ``jaxremat.remat`` of their loss) and the
``nn.scan`` decoder of ``tests/scan_models.py``.
Writes ``benchmarks/results/setup_time.md``. CPU, ``cse_barrier_expander`` off.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD = "flops"  # jaxremat.remat's default
FIRST_RUNS, SECOND_RUNS = 3, 5  # processes per model for each ratio, the median reported
MODELS = ("loop_decoder", "loop_mlp", "linen_cnn", "equinox", "nnx_list", "resnet", "gpt", "linen_scan")

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander")
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp
    import jaxremat as jr
    import outside_models, scan_models
    from outside_models import update_step

    def builtin(name):
        from jaxremat.tools import models
        if name == "resnet":
            model, x = models.resnet(), models.sample_input((32, 32, 32, 3))
        else:
            model, x = models.gpt(), models.sample_input((8, 128), "int32", high=512)
        v = model.init(jax.random.key(0), x)
        return lambda v, x: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2), (v, x), False

    name = {name!r}
    if name in ("resnet", "gpt"):
        loss, args, aux = builtin(name)
    else:
        case = (outside_models.CASES.get(name) or scan_models.CASES.get(name))()
        loss, args, aux = case.loss, case.args, case.has_aux
    t0 = time.perf_counter()
    update_step(loss, args, aux)
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    for budget in ("50%", "75%"):  # the first the model meets (a refusal's time counted too)
        f = jr.remat(loss, budget, method={method!r}, quiet=True)
        try:
            plan = f.plan(*args)
            break
        except jr.InfeasibleBudget:
            continue
    planned = time.perf_counter() - t0
    t0 = time.perf_counter()
    update_step(f, args, aux)
    compiled = time.perf_counter() - t0
    s = plan.setup
    print(json.dumps(dict(plain=plain, planned=planned, compiled=compiled, trace=s.trace, profile=s.profile,
                          plan=s.plan, verification=s.verification, cached=s.cached,
                          stages=plan.costs.length, budget=budget)))
    """
)


def run(name: str, cache: str) -> dict:
    code = CHILD.format(tests=str(ROOT / "tests"), name=name, method=METHOD)
    env = {**os.environ, "JAXREMAT_CACHE_DIR": cache, "JAXREMAT_CACHE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ratio(run: dict) -> float:
    """A process's setup (the plan and the planned step's compile) over its plain compile."""
    return (run["planned"] + run["compiled"]) / run["plain"]


def median(runs: list[dict]) -> dict:
    """The run whose :func:`ratio` is the median of ``runs``' (an odd number of them)."""
    return sorted(runs, key=ratio)[len(runs) // 2]


def row(name: str) -> str:
    # each ratio the median of its runs: one sample of a compile on this shared machine moves by a
    # third from run to run (the first call in a fresh cache folder each time; the second process
    # with the last one's)
    firsts = []
    for _ in range(FIRST_RUNS):
        with tempfile.TemporaryDirectory() as cache:
            firsts.append(run(name, cache))
            if len(firsts) == FIRST_RUNS:
                seconds = [run(name, cache) for _ in range(SECOND_RUNS)]
    first, second = median(firsts), median(seconds)
    plain = first["plain"]
    goal = max(5 * plain, plain + 10)
    total1 = first["planned"] + first["compiled"]
    total2 = second["planned"] + second["compiled"]
    split = f"{first['trace']:.1f} / {first['profile']:.1f} / {first['plan']:.1f} / {first['verification']:.1f}"
    ok1 = "yes" if total1 <= goal else "no"
    ok2 = "yes" if ratio(second) <= 1.5 else "no"
    return (
        f"| {name} | {first['budget']} | {first['stages']} | {plain:.1f} | "
        f"{total1:.1f} ({split}; compile {first['compiled']:.1f}) | "
        f"{ratio(first):.1f}x | {ok1} | {total2:.1f} | {ratio(second):.2f}x | {ok2} |"
    )


def main() -> None:
    names = sys.argv[1:] or list(MODELS)
    head = (
        "| model | budget | stages | plain compile s "
        "| first call s (trace / profile / plan / verify; planned step's compile) "
        "| first / plain | within goal | second process s | second / plain | within 1.5x |"
    )
    rows = [head, "|" + "---|" * 10]
    for name in names:
        rows.append(row(name))
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Setup time: the first call and a second process, against the plain compile",
            "",
            f"`python benchmarks/setup_time.py` ({datetime.date.today()}, CPU, jax "
            f"{__import__('jax').__version__}, `jaxremat.remat(loss, '50%', method={METHOD!r})` (75% where 50% is "
            "refused), each run in a fresh "
            f"process; the second with the first one's cache folder; the medians of {FIRST_RUNS} and {SECOND_RUNS} "
            "processes shown). "
            "Goal: the first call at most 5x the plain "
            "compile or the plain compile + 10 s; the second process at most 1.5x.",
            "",
            *rows,
            "",
        ]
    )
    if not sys.argv[1:]:
        (ROOT / "benchmarks" / "results" / "setup_time.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
