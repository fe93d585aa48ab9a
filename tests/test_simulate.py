import dataclasses

import pytest

import jaxremat as jr
from jaxremat.core.simulator import Machine
from jaxremat.solvers import baselines


def chain():
    # x = sizes of a_0..a_3, xbar includes each stage's output
    return jr.ChainCosts(
        x=[100, 10, 20, 30], xbar=[15, 25, 35], fwd=[1, 2, 3], bwd=[4, 5, 6], fwd_tmp=[1, 2, 3], bwd_tmp=[7, 8, 9]
    )


def test_store_all_peak_and_time_by_hand():
    c = chain()
    peak, time = jr.simulate(c, baselines.store_all(3))
    # Fall 0: 0+15+1; Fall 1: 15+25+2; Fall 2: 40+35+3=78; Loss: 75+30=105;
    # B2: 105+20+9=134; then cur=75+30-... B1: (15+25+20)+10+8=78; B0: (15+10)+100+7
    assert peak == 100 + max(16, 42, 78, 105, 134, 78, 15 + 10 + 100 + 7)
    assert time == 1 + 2 + 3 + 4 + 5 + 6


def test_every_stage_peak_by_hand():
    c = chain()
    ops = baselines.every_stage(3)
    assert ops[:3] == [("Fck", 0), ("Fck", 1), ("Fck", 2)]
    peak, time = jr.simulate(c, ops)
    assert time == 2 * (1 + 2 + 3) + 4 + 5 + 6
    # B 2 with a_1, a_2 held, abar_2 and delta_3 live: 10+20+35+30 + x[2] + bwd_tmp[2];
    # B 0 with abar_0 and delta_1 live creates delta_0 (x[0] = 100)
    assert peak == 100 + max(10 + 20 + 35 + 30 + 20 + 9, 15 + 10 + 100 + 7)


@pytest.mark.parametrize(
    "ops,words",
    [
        ([("Fn", 1)], r"op #0 \('Fn', 1\): a_1 is not live"),
        ([("Fall", 0), ("Fck", 0)], r"op #1 \('Fck', 0\): a_1 is already live"),
        ([("Fall", 0), ("B", 0)], r"op #1 \('B', 0\): a backward op before Loss"),
        ([("Fall", 0), ("Fall", 1), ("Fall", 2), ("Loss", 3), ("B", 1)], "expected the backward of stage 2"),
        ([("Fck", 0), ("Fck", 1), ("Fck", 2), ("Loss", 3), ("B", 2)], r"abar_2 is not live"),
        (
            [("Fn", 0), ("Fn", 1), ("Fall", 2), ("Loss", 3), ("B", 2), ("Fall", 1), ("B", 1)],
            r"op #5 \('Fall', 1\): a_1 is not live",
        ),
        ([("Fall", 0), ("Fall", 1), ("Fall", 2), ("Loss", 3), ("Loss", 3)], "Loss runs exactly once"),
        ([("Fwd", 0)], "unknown op kind"),
        ([("Fall", 7)], "out of range"),
        ([("Loss", 2)], r"the loss op is \('Loss', 3\)"),
        ([("Fall", 0)], "ends before the backward is complete"),
        (["oops"], "not a \\(kind, stage\\) pair"),
    ],
)
def test_invalid_schedules_name_position_and_reason(ops, words):
    with pytest.raises(ValueError, match=words):
        jr.simulate(chain(), ops)


def test_fn_frees_its_input_but_never_a0():
    c = chain()
    ops = [("Fn", 0), ("Fn", 1), ("Fall", 2), ("Loss", 3), ("B", 2)]
    # after Fn 1, a_1 is gone, so the backward of stage 1 needs a recomputation from a_0
    ops += [("Fck", 0), ("Fall", 1), ("B", 1), ("Fall", 0), ("B", 0)]
    peak, time = jr.simulate(c, ops)
    assert time == (1 + 2 + 3) + 6 + 1 + 2 + 5 + 1 + 4


def test_schedule_summary_reads_well():
    c = chain()
    s = jr.solve(c, None, algorithm="every_stage")
    text = s.summary()
    assert "input checkpointed (Fck), recomputed 1x" in text
    assert [d.recomputed for d in s.decisions()] == [1, 1, 1]
    assert s.overhead == pytest.approx((12 + 15) / 21)


def test_shared_values_count_once_and_held_bytes_until_their_backward():
    """A value in a_1 .. a_3 is one buffer: checkpoints holding it count it once; bytes held until
    a stage's backward count from the start and go when that backward runs."""
    costs = jr.ChainCosts(
        x=[0, 100, 100, 100, 10],
        xbar=[100, 100, 100, 10],
        fwd=[1] * 4,
        bwd=[1] * 4,
        fwd_tmp=[0] * 4,
        bwd_tmp=[0] * 4,
        fb_tmp=[0] * 4,
        shared=[jr.Shared(1, 3, 60)],
    )
    ops = [("Fck", 0), ("Fck", 1), ("Fck", 2), ("Fall", 3), ("Loss", 4), ("B", 3), ("FB", 2), ("FB", 1), ("FB", 0)]

    def steps(c):
        m = Machine(c)
        return [m.step(op, n) for n, op in enumerate(ops)]

    # a_1 = 40 own + the 60 shared; a_2 and a_3 add their own 40 each; B 3 adds delta_3 (100)
    assert steps(costs)[:6] == [100, 140, 180, 190, 200, 300]
    assert steps(costs.without_shared())[:6] == [100, 200, 300, 310, 320, 420]
    assert jr.simulate(costs, ops).peak < jr.simulate(costs.without_shared(), ops).peak
    late = steps(dataclasses.replace(costs, held=[0, 0, 0, 7]))
    assert late[:6] == [107, 147, 187, 197, 207, 300]  # until B 3, which makes them delta_3
    early = steps(dataclasses.replace(costs, held=[50, 0, 0, 0]))
    assert [e - p for e, p in zip(early, steps(costs))] == [50] * 8 + [0]  # until B 0
    with pytest.raises(ValueError, match="more than x"):
        jr.ChainCosts(
            x=[0, 10, 10, 10],
            xbar=[10] * 3,
            fwd=[1] * 3,
            bwd=[1] * 3,
            fwd_tmp=[0] * 3,
            bwd_tmp=[0] * 3,
            shared=[jr.Shared(1, 3, 60)],
        )
    with pytest.raises(ValueError, match="spans a_0 .. a_2"):
        jr.ChainCosts(
            x=[100] * 4,
            xbar=[100] * 3,
            fwd=[1] * 3,
            bwd=[1] * 3,
            fwd_tmp=[0] * 3,
            bwd_tmp=[0] * 3,
            shared=[jr.Shared(0, 2, 6)],
        )
    with pytest.raises(ValueError, match="not modelled"):
        jr.simulate(costs, [("Fck", 0), ("Offload", 1, "a")] + ops[1:], bandwidth=1.0)
    held = dataclasses.replace(costs, held=[1, 2, 3, 4])
    assert jr.ChainCosts.from_dict(held.to_dict()) == held


def test_a_long_blocks_least_peak_is_never_below_the_input():
    """``Schedule.least_peak`` subtracts every boundary inside the blocks, not only those live at
    the peak: one block over a long chain of large boundaries and a small input would go below
    zero; the least any schedule may measure is the input it holds."""
    from jaxremat.core.ops import store_all_ops
    from jaxremat.core.schedule import Block, Schedule

    L = 8
    x = [100] + [10_000] * L
    costs = jr.ChainCosts(x=x, xbar=[1] * L, fwd=[1.0] * L, bwd=[2.0] * L, fwd_tmp=[0] * L, bwd_tmp=[0] * L)
    sched = Schedule.from_ops(costs, store_all_ops(L), budget=None, algorithm="blocks", blocks=(Block(0, L, "x"),))
    assert sched.peak - sum(x[1:L]) < x[0]  # what the old bound gave
    assert sched.least_peak == x[0]
