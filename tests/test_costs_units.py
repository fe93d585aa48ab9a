import math

import numpy as np
import pytest

import jaxremat as jr
from jaxremat.core.units import parse_bytes
from jaxremat.core.budgets import parse_budget


def good(**over):
    d = dict(x=[4, 4, 4], xbar=[8, 8], fwd=[1.0, 1.0], bwd=[2.0, 2.0], fwd_tmp=[0, 0], bwd_tmp=[0, 0])
    d.update(over)
    return d


def test_costs_store_read_only_arrays():
    c = jr.ChainCosts(**good())
    assert c.length == 2 and c.x.dtype == np.int64 and c.fwd.dtype == np.float64
    with pytest.raises(ValueError):
        c.x[0] = 1


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("fwd", [1.0, math.nan], "fwd[1] is NaN"),
        ("bwd", [math.inf, 1.0], "bwd[0] is infinite"),
        ("x", [4, -1, 4], "x[1] is negative"),
        ("xbar", [8, 2.5], "xbar[1] = 2.5 is not a whole number"),
        ("fwd_tmp", [0, "a"], "fwd_tmp[1] is not a number"),
        ("x", [4, 4], "x has 2 entries but xbar has 2"),
        ("bwd_tmp", [0], "bwd_tmp has 1 entries; expected L = 2"),
        ("fb_reuse", [0, -4], "fb_reuse[1] is negative"),
        ("fb_reuse", [4], "fb_reuse has 1 entries; expected L = 2"),
    ],
)
def test_costs_refuse_bad_values_naming_array_and_index(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        jr.ChainCosts(**good(**{field: value}))


def test_empty_chain_refused():
    with pytest.raises(ValueError, match="empty chain"):
        jr.ChainCosts(x=[1], xbar=[], fwd=[], bwd=[], fwd_tmp=[], bwd_tmp=[])


def test_costs_round_trip_and_equality():
    c = jr.ChainCosts(**good(), names=["a", "b"])
    assert jr.ChainCosts.from_dict(c.to_dict()) == c
    assert c != jr.ChainCosts(**good())
    reuse = jr.ChainCosts(**good(), fb_reuse=[4, 0])
    assert jr.ChainCosts.from_dict(reuse.to_dict()) == reuse != jr.ChainCosts(**good())
    assert jr.ChainCosts(**good()).fb_reuse.tolist() == [0, 0]
    with pytest.raises(ValueError, match="missing field"):
        jr.ChainCosts.from_dict({"x": [1]})
    # every field counts: per-device sizes and the flops are part of what the costs say
    assert jr.ChainCosts(**good(), devices=8) != jr.ChainCosts(**good())
    flops = jr.ChainCosts(**good(), fwd_flops=[1.0, 2.0], bwd_flops=[2.0, 4.0])
    assert flops != jr.ChainCosts(**good()) and jr.ChainCosts.from_dict(flops.to_dict()) == flops


@pytest.mark.parametrize(
    "text,expected",
    [
        (1024, 1024),
        (1e3, 1000),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5 GiB", int(1.5 * 2**30)),
        ("4096", 4096),
        ("3kb", 3000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "MiB", "", "-5", True, [1], math.nan])
def test_parse_bytes_refuses_with_accepted_forms(bad):
    with pytest.raises(ValueError) as e:
        parse_bytes(bad)
    assert "byte size" in str(e.value)


def test_budget_forms_on_a_chain():
    c = jr.ChainCosts(**good())
    peak = jr.store_all_peak(c)
    assert jr.solve(c, "100%", algorithm="store_all").budget == peak
    assert jr.solve(c, None, algorithm="store_all").budget == peak
    assert parse_budget("50%", c) == peak // 2
    assert parse_budget("1KiB", c) == 1024
    with pytest.raises(ValueError, match="expected an int of bytes"):
        jr.solve(c, "lots")
    with pytest.raises(ValueError, match="share of the store-all peak"):
        jr.parse_budget("40%")


def test_format_bytes():
    assert jr.format_bytes(512) == "512 B"
    assert jr.format_bytes(1536) == "1.50 KiB"
    assert jr.format_bytes(3 * 2**30) == "3.00 GiB"


def test_optional_flops_round_trip_and_table():
    c = jr.ChainCosts(**good(), names=["conv", "head"], fwd_flops=[2e9, 1e9], bwd_flops=[4e9, 2e9])
    assert jr.ChainCosts.from_dict(c.to_dict()).fwd_flops.tolist() == [2e9, 1e9]
    text = c.table()
    assert "conv" in text and "GFLOP" in text and "input a_0: 4 B" in text
    assert "2000" in jr.ChainCosts(**good()).table(time_unit="ms")  # 2.0 s backward shown in ms
    with pytest.raises(ValueError, match="fwd_flops has 1 entries"):
        jr.ChainCosts(**good(), fwd_flops=[1.0])
    with pytest.raises(ValueError, match=r"bwd_bytes\[0\] is negative"):
        jr.ChainCosts(**good(), bwd_bytes=[-1.0, 0.0])


def test_every_array_of_the_record_is_validated_compared_and_saved():
    # the arrays' field metadata is the one description: a new array cannot be left out of
    # validation, equality, the hash or the plan file
    from jaxremat.core.costs import array_fields

    base = jr.ChainCosts(**good())
    for f in array_fields():
        n = len(getattr(base, f.name)) if getattr(base, f.name) is not None else 2
        changed = next(c for v in (3, 1) if (c := jr.ChainCosts(**{**good(), f.name: [v] * n})) != base)
        assert jr.ChainCosts.from_dict(changed.to_dict()) == changed and hash(changed) != hash(base), f.name
        with pytest.raises(ValueError, match="entries"):
            jr.ChainCosts(**{**good(), f.name: [1]})
    assert {f.name for f in array_fields() if f.metadata["absent"] == "required"} == {
        "x", "xbar", "fwd", "bwd", "fwd_tmp", "bwd_tmp"}
