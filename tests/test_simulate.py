import pytest

import jaxremat as jr
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
        ([("Fn", 0), ("Fn", 1), ("Fall", 2), ("Loss", 3), ("B", 2), ("Fall", 1), ("B", 1)],
         r"op #5 \('Fall', 1\): a_1 is not live"),
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
