"""How ``jaxremat.remat`` ranks schedules, three ways side by side: the roofline time model
(``method="xla"``: flops or bytes accessed) with the fastest plan kept, as before 2026-12-06; the
roofline with the leanest plan within :data:`~jaxremat.solvers.lean.LEAN_TIE` of the fastest; and
the default, ``method="flops"`` (each program's compiled flops at the device's flop rate) with the
leanest plan.

For each model and budget, in a fresh process: the plain training step is compiled first (so
that neither plan pays the process's first compile), then the function is planned each way
with no disk cache (profile, plan, verification), and the three planned training steps
(Adam, donated, as ``tests/outside_models.update_step`` builds them) are timed in interleaved
rounds, the fastest call of each kept. Reported per model: the verification's compiles of the
step, what it chose, XLA's temp against the budget, the step's compiled flops, the first call's
seconds and the step's time.

Verification ranks the schedules that fit by the flops of the compiled step; under ``"flops"``
the solver ranks them the same way, so verification compiles no hand strategy only because the
roofline ranked it below the plan.

    python benchmarks/time_models.py [model:budget ...]

Writes ``benchmarks/results/time_models.md`` (when run without arguments). CPU,
``cse_barrier_expander`` off.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = (
    "resnet:50%", "resnet:75%", "gpt:30%", "gpt:50%", "gpt:75%", "loop_mlp:50%", "nnx_list:50%",
    "linen_cnn:75%", "linen_scan:50%",
)  # fmt: skip
#: (name, method, leanest plan)
WAYS = (("roofline, fastest", "xla", False), ("roofline, leanest", "xla", True), ("flops, leanest", "flops", True))
ROUNDS = 7

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=cse_barrier_expander")
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, optax
    import jaxremat as jr
    import outside_models, scan_models
    from outside_models import update_step
    import jaxremat.api.remat_fn as remat_fn
    leanest = remat_fn.leanest

    name, budget = {name!r}, {budget!r}
    if name in ("resnet", "gpt"):
        from jaxremat.tools import models
        if name == "resnet":
            model, x = models.resnet(), models.sample_input((32, 32, 32, 3))
        else:
            model, x = models.gpt(), models.sample_input((8, 128), "int32", high=512)
        v = model.init(jax.random.key(0), x)
        loss, args, aux = (lambda v, x: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2)), (v, x), False
    else:
        case = (outside_models.CASES.get(name) or scan_models.CASES.get(name))()
        loss, args, aux = case.loss, case.args, case.has_aux
    update_step(loss, args, aux)  # the process's first compiles, paid by neither plan

    def runnable(fun):
        opt = optax.adam(1e-3)
        leaves, tree = jax.tree.flatten(args[0])
        floats = [n for n, l in enumerate(leaves) if isinstance(l, jax.Array) and jnp.issubdtype(l.dtype, jnp.inexact)]
        other = {{n: l for n, l in enumerate(leaves) if n not in floats}}

        def first(p):
            full = [other[n] if n in other else p[floats.index(n)] for n in range(len(leaves))]
            return jax.tree.unflatten(tree, full)

        def step(p, state, rest):
            value, g = jax.value_and_grad(lambda p, *r: fun(first(p), *r), has_aux=aux)(p, *rest)
            updates, state = opt.update(g, state, p)
            return value, optax.apply_updates(p, updates), state

        p0 = [jnp.array(leaves[n]) for n in floats]
        return jr.jit(step, donate_argnums=(0, 1)), [p0, opt.init(p0), args[1:]]

    out, steps = {{}}, {{}}
    for way, method, lean in {ways!r}:
        remat_fn.leanest = leanest if lean else (lambda costs, fastest, **kw: fastest)
        t0 = time.perf_counter()
        f = jr.remat(loss, budget, method=method, quiet=True)
        plan = f.plan(*args)
        first_call = time.perf_counter() - t0
        v = plan.verification
        step, state = runnable(f)
        t0 = time.perf_counter()
        state[0], state[1] = step(*state)[1:]
        jax.block_until_ready(state[0])
        out[way] = dict(first=first_call + time.perf_counter() - t0, compiles=v.compiles, chosen=v.chosen,
                           measured=v.measured_peak, budget=v.budget, flops=v.flops, best=1e9)
        steps[way] = (step, state)
    for _ in range({rounds}):
        for way, (step, state) in steps.items():
            for _ in range(3):
                t0 = time.perf_counter()
                state[0], state[1] = step(*state)[1:]
                jax.block_until_ready(state[0])
                out[way]["best"] = min(out[way]["best"], time.perf_counter() - t0)
    print(json.dumps(out))
    """
)


def run(case: str) -> dict:
    name, budget = case.split(":")
    code = CHILD.format(tests=str(ROOT / "tests"), name=name, budget=budget, ways=WAYS, rounds=ROUNDS)
    env = {**os.environ, "JAXREMAT_CACHE": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{case}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(case: str) -> str:
    got = run(case)
    cells = []
    for way, _, _ in WAYS:
        r = got[way]
        cells.append(
            f"{r['compiles']}, {r['chosen']}, {r['measured'] / r['budget']:.2f}, {r['flops']:.3g}, "
            f"{r['first']:.1f} s, {r['best'] * 1e3:.1f} ms"
        )
    ratio = got[WAYS[-1][0]]["best"] / got[WAYS[0][0]]["best"]
    name, budget = case.split(":")
    return f"| {name} | {budget} | {' | '.join(cells)} | {ratio:.3f} |"


def main() -> None:
    cases = sys.argv[1:] or list(CASES)
    head = (
        "| model | budget | "
        + " | ".join(f"{way}: compiles, chosen, XLA temp / budget, flops, first call, step" for way, _, _ in WAYS)
        + f" | step time, {WAYS[-1][0]} / {WAYS[0][0]} |"
    )
    rows = [head, "|" + "---|" * (3 + len(WAYS))]
    for case in cases:
        rows.append(row(case))
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "# Ranking schedules: the roofline or compiled flops, the fastest plan or the leanest",
            "",
            f"`python benchmarks/time_models.py` ({datetime.date.today()}, CPU, jax "
            f"{__import__('jax').__version__}; each model in a fresh process after one plain compile, no disk "
            f"cache, the three planned Adam steps timed in {ROUNDS} interleaved rounds of 3 calls, the fastest "
            "kept). Compiles: the step compiled by verification (the plan, its corrections, the hand strategies).",
            "",
            *rows,
            "",
        ]
    )
    if not sys.argv[1:]:
        (ROOT / "benchmarks" / "results" / "time_models.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
