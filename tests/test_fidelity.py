"""The profiled cost model against XLA's compiled training step (CPU, remat made real).

Asserted here: store-all and every stage checkpointed (hand-written with jax.checkpoint, and run
by jaxremat's executor, whose recomputation is the contract's FB) within 15% of the prediction on
the MLP and CNN profile chains (the Transformer's too in benchmarks/results/profile_fidelity.md),
and the executor's on the safe side within 5%.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_fidelity import models, ratios  # noqa: E402

CASES = {label.split(" ")[0]: (label, chain, x) for label, chain, x in models(scale=4)}
CASES["MLP"] = next(case for case in models(scale=1) if case[0].startswith("MLP"))  # small batches: weights dominate


# the Transformer's row is the benchmark's (benchmarks/profile_fidelity.py); here it is checked by
# the tests below that plan it (the suite's time: its row took 100 s of the file's 630)
@pytest.mark.parametrize("model", ["MLP", "CNN"])
def test_xla_temp_within_15_percent_of_prediction(model):
    rows = {row[1]: (row[2], row[3]) for row in ratios(*CASES[model], returning=False)}
    assert len(rows) == 3
    for alg, (temp, pred) in rows.items():
        assert 0.85 <= temp / pred <= 1.15, (model, alg, temp, pred)
    temp, pred = rows["every_stage (jaxremat.execute)"]
    assert temp <= 1.05 * pred, (model, temp, pred)


def test_executed_schedule_stays_within_its_plan():
    """An optimal schedule run inside the training step: XLA temp <= 1.10 x the predicted peak
    and compiled flops within 6% of the predicted forward + backward + recomputation (store-all
    matches to 0.2%; XLA drops recomputation whose result the backward does not read, such as a
    block's last matmul (docs/cost_model.md), which the prediction counts)."""
    import jax

    import jaxremat as jr
    from fidelity import measure, predicted_flops
    from jaxremat import profile
    from jaxremat.profiling import Rates

    label, chain, x = CASES["Transformer"]
    v = chain.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True)
    for share in ("50%", "75%"):
        sched = jr.solve(costs, share)
        # something is really recomputed: a region, or a stage stored under a checkpoint policy
        assert any(d.recomputed or d.policy for d in sched.decisions())
        temp, flops = measure(chain, v, x, costs, sched)
        assert temp <= 1.05 * (sched.peak - int(costs.x[0])), (share, temp, sched.peak)
        assert abs(flops / predicted_flops(costs, sched) - 1) <= 0.06, (share, flops)


@pytest.mark.parametrize("share,policies", [("40%", ()), ("60%", ()), ("50%", None)])
def test_resnet_schedule_stays_within_its_plan(share, policies):
    """Residual blocks mixing stored and recomputed stages: XLA must not keep a recomputed
    region's internals (it fuses their element-wise tail into the next stage unless the region's
    output is materialised: 1.08x here without), and the transposed input copies a block's
    backward keeps must be in its ``xbar`` (1.20x without both). Measured 0.97-0.98x; asserted
    at 1.05x, tighter than the 1.10x target, so that either regression fails. Without store
    options (``policies=()``) the plan mixes regions and stored stages; with them (by default) it
    stores blocks under dots_saveable too (0.98x)."""
    import jax

    import jaxremat as jr
    from fidelity import measure
    from jaxremat.tools import models as zoo
    from jaxremat.model.chain import Chain
    from jaxremat import profile
    from jaxremat.profiling import Rates

    chain = Chain.from_linen(zoo.resnet(blocks=(2, 2, 2)))
    x = zoo.sample_input((16, 32, 32, 3))
    v = chain.init(jax.random.key(0), x)
    costs = profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True, policies=policies)
    sched = jr.solve(costs, max(jr.parse_budget(share, costs), jr.min_budget(costs)))
    if policies == ():
        assert {op[0] for op in sched.ops} >= {"Fck", "Fall"}  # a mix of checkpointed and stored stages
    else:
        assert any(d.policy for d in sched.decisions())  # stages stored under a policy
    temp, _ = measure(chain, v, x, costs, sched)
    assert temp <= 1.05 * (sched.peak - int(costs.x[0])), (share, temp, sched.peak)


def test_nested_regions_stay_within_their_plan():
    """The least-budget schedule of a 12-block GPT nests one region per block. An inner region's
    weight gradients pass only its own barrier: held through every enclosing one, the attention
    kernels' gradients (in a layout other than their outputs') stayed temporaries until the end
    of the step, 1.08x the plan. In the update step it was 1.18x while a backward credited an
    output written over any dying input (now only over the cotangent, as FB): 1.04x. Counting
    the bytes an element-wise output shares with the dying temporary under it once, 1.059x, the
    embedding's zero-made gradient (held from the first backward's forward to the step's end)
    unpredicted; with it held (profile version 23), 1.026x; with every kernel read ordered before
    the kernel's update (no copies of them, test_recomputation_reads_kernels_before_their_update),
    0.96x on the measured profile."""
    import jax

    import jaxremat as jr
    from jaxremat.api.calibrate import step_temp
    from jaxremat.model.chain import Chain
    from jaxremat.profiling import Rates
    from jaxremat.tools import models as zoo

    x = zoo.sample_input((4, 128), "int32")
    chain = Chain.from_linen(zoo.gpt(blocks=12))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True, policies={})
    sched = jr.solve(costs, jr.min_budget(costs), algorithm="optimal")
    assert sum(op.kind == "Fck" for op in sched.ops) > 6  # regions inside regions
    pred = sched.peak - int(costs.x[0])
    assert step_temp(chain, v, x, sched) <= 1.05 * pred


def test_recomputation_reads_kernels_before_their_update(monkeypatch):
    """The conv autoencoder's least-budget plan nests a region per stage, all from the chain's
    input. In the update step each kernel's update must follow every read of it, or XLA copies
    the kernel at the step's start: the outer recomputation of an inner region's stages feeds no
    gradient of theirs (the mark orders it), and the reads for input gradients reach no barrier
    where the region's input cotangent is dead (the tap orders them). Without either, 1.24x the
    plan (measured 2026-12-04)."""
    import jax

    import jaxremat as jr
    import jaxremat.run._walk as walk
    from jaxremat.api.calibrate import step_temp
    from jaxremat.model.chain import Chain
    from jaxremat.profiling import Rates
    from jaxremat.tools import models as zoo

    chain = Chain.from_linen(zoo.autoencoder(width=16, depth=2))
    x = zoo.sample_input((4, 32, 32, 3))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True, policies={})
    least = jr.solve(costs, jr.min_budget(costs))
    assert sum(op.kind == "Fck" for op in least.ops) >= costs.length  # regions inside regions
    pred = least.peak - int(costs.x[0])
    assert step_temp(chain, v, x, least) <= 1.02 * pred
    monkeypatch.setattr(walk, "mark_of", lambda a: None)
    assert step_temp(chain, v, x, least) >= 1.1 * pred
    monkeypatch.undo()
    monkeypatch.setattr(walk, "last_read", lambda inner: None)
    assert step_temp(chain, v, x, least) >= 1.1 * pred


def test_a_backward_writes_over_its_incoming_cotangent(monkeypatch):
    """XLA writes an element-wise output over a dying operand only when the user reads the
    instruction that made it, never an optimisation barrier's copy. A residual block's ``FB``
    writes its relu derivative over the incoming cotangent (``fb_tmp`` takes credit for it), so
    the executor's barriers order the backward after the cotangent without handing it the
    barrier's copy: in a region (the least-budget plan, one ``FB`` after another) and after a
    stored convolution's tie (blocks stored whole before a recomputed one).
    Through the barriers the first used one activation (1 MiB) more than planned. (The tie's
    handover showed with blocks stored under ``dots_saveable``, 0.23 MiB; stages under a policy
    are no longer tied, and stored whole here they show no difference.) Between two regions (every block a region of
    its own) the input's
    cotangent leaves the later one as it was made, ordered by a token instead of the barrier
    (``ChainCosts.fb_reuse``), and so does a region inside a region that starts it (revolve's
    schedule); through the barrier, again one activation more."""
    import jax

    import jaxremat as jr
    import jaxremat.run._walk as walk
    from jaxremat.api.calibrate import step_temp
    from jaxremat.core.ops import Op
    from jaxremat.core.schedule import Schedule
    from jaxremat.model.chain import Chain
    from jaxremat.profiling import Rates
    from jaxremat.tools import models as zoo

    chain = Chain.from_linen(zoo.resnet(blocks=(2, 2, 2)))
    x = zoo.sample_input((16, 32, 32, 3))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True)
    L, x0 = costs.length, int(costs.x[0])
    least = jr.solve(costs, jr.min_budget(costs))
    assert [op.kind for op in least.ops].count("FB") == L
    stored = [Op("Fall", 0, 2), Op("Fall", 1, 2), Op("Fck", 2)] + [Op("Fall", i) for i in range(3, L - 1)]
    back = [Op("B", i) for i in range(L - 1, 2, -1)] + [Op("FB", 2), Op("B", 1), Op("B", 0)]
    mixed = Schedule.from_ops(costs, stored + [Op("Fall", L - 1), Op("Loss", L)] + back, budget=None, algorithm="x")
    every = jr.solve(costs, None, algorithm="every_stage")
    # revolve's: regions inside regions, the first inner one handing the cotangent over too
    nested = Schedule.from_ops(
        costs,
        [
            Op(*op)
            for op in (
                ("Fck", 0),
                ("Fn", 1),
                ("Fn", 2),
                ("Fck", 3),
                ("Fn", 4),
                ("Fn", 5),
                ("Fck", 6),
                ("Fn", 7),
                ("Loss", 8),
                ("Fck", 6),
                ("FB", 7),
                ("FB", 6),
                ("Fck", 3),
                ("Fck", 4),
                ("FB", 5),
                ("FB", 4),
                ("FB", 3),
                ("Fck", 0),
                ("Fck", 1),
                ("FB", 2),
                ("FB", 1),
                ("FB", 0),
            )
        ],
        budget=None,
        algorithm="x",
    )
    assert costs.fb_reuse[1] > 0 and costs.fb_reuse[2] > 0  # relu(x + h)'s derivative written over the cotangent
    runs = (("least", least), ("mixed", mixed), ("every", every), ("nested", nested))
    temp = {name: step_temp(chain, v, x, s) for name, s in runs}
    assert temp["least"] <= 1.01 * (least.peak - x0)
    assert temp["mixed"] <= mixed.peak - x0
    assert temp["every"] <= 1.01 * (every.peak - x0)
    assert temp["nested"] <= 1.01 * (nested.peak - x0)

    monkeypatch.setattr(walk.Walker, "handovers", lambda self, run: [False] * len(run))
    assert step_temp(chain, v, x, every) >= every.peak - x0 + 0.9 * 2**20
    monkeypatch.undo()

    region = walk.tied_checkpoint
    barrier = lambda body, **kw: region(body, **{**kw, "enters": walk.Enters.BARRIER})  # noqa: E731
    monkeypatch.setattr(walk, "tied_checkpoint", barrier)
    assert step_temp(chain, v, x, least) >= least.peak - x0 + 0.9 * 2**20
    monkeypatch.undo()


def test_stored_blocks_make_their_kernel_copies_in_their_backward(monkeypatch):
    """In the update step XLA made a copy of each reshaped attention kernel at the step's start
    and kept it until the block's backward (four 64 KiB copies per GPT block; profile versions
    14-18 counted them in ``xbar``). With the executor's kernel reads ordered after the output's
    cotangent (:func:`jaxremat.run._grad_tie.tied_gradients`), they are made in the backward:
    the 12-block GPT's store-all plan, which no longer counts them, is within 3% of XLA, and
    without the ordering XLA uses 3 MiB more than it."""
    import jax

    import jaxremat as jr
    import jaxremat.run._walk as walk
    from jaxremat.api.calibrate import step_temp
    from jaxremat.model.chain import Chain
    from jaxremat.profiling import Rates
    from jaxremat.tools import models as zoo

    x = zoo.sample_input((4, 128), "int32")
    chain = Chain.from_linen(zoo.gpt(blocks=12))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True, policies={})
    sched = jr.solve(costs, None, algorithm="store_all")
    pred = sched.peak - int(costs.x[0])
    assert 0.97 * pred <= step_temp(chain, v, x, sched) <= 1.03 * pred
    monkeypatch.setattr(walk, "tied_gradients", lambda apply: apply)
    assert step_temp(chain, v, x, sched) >= pred + 3 * 2**20


def test_the_last_stage_is_measured_with_the_loss(monkeypatch):
    """XLA fuses the step's loss with the last stage's forward and backward: with a GPT's LM head
    whose kernel reads are not ordered after its cotangent it keeps five logit-sized buffers at
    once, more than the head's backward measured alone. With ``loss=`` the profile measures the
    head with the loss, and the store-all plan is XLA's memory within 2%; measured alone, the
    plan is under XLA by more. With the executor's ordering (the profile's too), both are within
    2%."""
    import jax

    import jaxremat as jr
    import jaxremat.profiling.stage_memory as stage
    import jaxremat.run._walk as walk
    from jaxremat.api.calibrate import measured_loss, step_temp
    from jaxremat.model.chain import Chain
    from jaxremat.profiling import Rates
    from jaxremat.tools import models as zoo

    x = zoo.sample_input((4, 128), "int32")
    chain = Chain.from_linen(zoo.gpt(blocks=2))
    v = chain.init(jax.random.key(0), x)

    def ratios(cache: bool) -> dict:
        out = {}
        for loss in (None, measured_loss):  # the cache shares the stages before the last
            costs = jr.profile(
                chain, v, x, method="xla", rates=Rates(1e10, 1e10), cache=cache, quiet=True, policies={}, loss=loss
            )
            sched = jr.solve(costs, None, algorithm="store_all")
            out[loss is not None] = step_temp(chain, v, x, sched) / (sched.peak - int(costs.x[0]))
        return out

    ordered = ratios(cache=True)
    assert all(0.98 <= r <= 1.02 for r in ordered.values()), ordered
    monkeypatch.setattr(walk, "tied_gradients", lambda apply: apply)
    monkeypatch.setattr(stage, "orders_kernel_reads", lambda rest, a: False)
    unordered = ratios(cache=False)  # monkeypatched: nothing from the cache
    assert 0.98 <= unordered[True] <= 1.02, unordered
    assert unordered[False] > unordered[True] + 0.02, unordered


def test_a_loss_that_is_not_a_function_is_refused():
    import jax
    import pytest

    import jaxremat as jr
    from jaxremat.model.chain import Chain
    from jaxremat.tools import models as zoo

    x = zoo.sample_input((1, 16), "int32")
    chain = Chain.from_linen(zoo.gpt(blocks=1, width=32, vocab=64))
    v = chain.init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="loss must be a function"):
        jr.profile(chain, v, x, method="xla", quiet=True, loss="mse")


def test_a_tap_keeps_no_cotangent_alive():
    """The tap (:func:`jaxremat.run._regions.tap`) orders a region's weight gradients after one
    element of a cotangent; that element is made as soon as the cotangent is, or the whole
    cotangent stays alive until the weight gradients. On a chain of 16 ``tanh(x @ w)`` stages,
    the 30% plan below (``jaxremat.remat`` picked it for such a chain on CI's run and on one of
    four here; its last region holds a stored stage and a region over stages 1-3) used 1.12x its prediction
    (measured 2026-12-04), a schedule differing only in that last region 0.90x."""
    import jax
    import jax.numpy as jnp
    from conftest import TanhDense

    import jaxremat as jr
    from jaxremat.core.ops import Op
    from jaxremat.core.schedule import Schedule
    from jaxremat.model.chain import Chain
    from jaxremat.profiling import Rates
    from jaxremat.run.executor import execute

    chain = Chain.from_linen([TanhDense() for _ in range(16)])
    x = jax.random.normal(jax.random.key(1), (128, 64))
    v = chain.init(jax.random.key(0), x)
    costs = jr.profile(chain, v, x, method="xla", rates=Rates(1e10, 1e10), quiet=True)
    fwd = (
        [("Fck", 0)]
        + [("Fn", i) for i in range(1, 11)]
        + [("Fck", 11), ("Fn", 12), ("Fn", 13), ("Fn", 14), ("Fck", 15), ("Loss", 16)]
    )
    back = (
        [
            ("FB", 15),
            ("Fck", 11),
            ("Fn", 12),
            ("Fn", 13),
            ("FB", 14),
            ("Fck", 11),
            ("Fn", 12),
            ("FB", 13),
            ("Fall", 11),
            ("FB", 12),
            ("B", 11),
            ("Fck", 0),
        ]
        + [("Fn", i) for i in range(1, 7)]
        + [
            ("Fck", 7),
            ("Fn", 8),
            ("Fn", 9),
            ("FB", 10),
            ("Fck", 7),
            ("Fn", 8),
            ("FB", 9),
            ("Fall", 7),
            ("FB", 8),
            ("B", 7),
            ("Fck", 0),
            ("Fn", 1),
            ("Fn", 2),
            ("Fn", 3),
            ("Fck", 4),
            ("Fn", 5),
            ("FB", 6),
            ("Fall", 4),
            ("FB", 5),
            ("B", 4),
        ]
    )
    last = [("Fall", 0), ("Fck", 1), ("Fn", 2), ("FB", 3), ("Fall", 1), ("FB", 2), ("B", 1), ("B", 0)]
    sched = Schedule.from_ops(costs, [Op(*op) for op in fwd + back + last], budget=None, algorithm="x")
    f = execute(chain, sched)
    step = jr.jit(jax.value_and_grad(lambda v: jnp.mean(f(v, x)[0] ** 2)))
    temp = step.lower(v).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 1.02 * (sched.peak - int(costs.x[0])), (temp, sched.peak - int(costs.x[0]))
