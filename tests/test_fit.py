"""``jaxremat fit``: the largest input size that fits a device, per strategy, by bisection on
XLA-measured compiles of the whole training step."""

from __future__ import annotations

import json

import flax.linen as nn
import pytest
from hypothesis import given
from hypothesis import strategies as st

import jaxremat as jr
from jaxremat.tools.cli import main
from jaxremat.tools.fit import JAXREMAT, fit, largest, model_strategies, size_grid, step_bytes
from jaxremat.tools.models import ScanDecoder


@given(st.integers(1, 300), st.integers(0, 400), st.data())
def test_bisection_finds_the_largest_size_that_fits(lo, extra, data):
    grid = size_grid(lo, lo + extra)
    assert grid[0] == lo and grid[-1] == lo + extra and list(grid) == sorted(set(grid))
    limit = data.draw(st.integers(0, lo + extra + 5))
    tried = []

    def fits(size):
        tried.append(size)
        return size <= limit

    want = max((s for s in grid if s <= limit), default=None)
    assert largest(fits, grid) == want
    assert len(tried) <= 3 + len(grid).bit_length()


def test_a_model_written_as_a_scan_offers_its_own_remat_policies():
    names = set(model_strategies(ScanDecoder(blocks=2, width=16, heads=2, vocab=32), (2, 8), "int32"))
    assert names == {"no remat", "remat every block", "policy dots_saveable", "policy dots_with_no_batch_dims_saveable"}
    with pytest.raises(ValueError, match="remat must be one of"):
        model_strategies(ScanDecoder(remat="some"), (2, 8), "int32")["no remat"](2)


def mlp():
    return nn.Sequential([nn.Dense(256), nn.gelu, nn.Dense(256), nn.gelu, nn.Dense(256), nn.gelu, nn.Dense(8)])


def test_every_strategy_fits_as_xla_measures_and_jaxremat_fits_the_most():
    every = model_strategies(mlp(), (4, 32, 256))  # activations, not parameters, grow with the batch
    strategies = {name: every[name] for name in ("no remat", "remat every block", "policy dots_saveable")}
    plain = step_bytes(*strategies["no remat"](64), jr.api.calibrate.measured_optimizer())
    result = fit(strategies, jr.Device(int(plain * 0.8), headroom=0.0), sizes=(8, 96), steps=0, quiet=True)
    sizes = {r.strategy: r.size for r in result.rows}
    assert 8 <= sizes["no remat"] < 64 and sizes[JAXREMAT] >= max(s or 0 for s in sizes.values())
    for row in result.rows:
        assert row.used <= result.usable or row.size is None
        assert all(b > result.usable for s, b, _ in row.curve if row.size is not None and s > row.size)
    assert "| jaxremat |" in result.table()


def test_too_small_a_device_names_the_least_memory_and_the_cli_writes_json_and_a_plot(tmp_path, capsys):
    with pytest.raises(jr.InfeasibleBudget, match="measured by XLA at batch 8"):
        fit(model_strategies(mlp(), (4, 256)), jr.Device("1MiB"), sizes=(8, 16), steps=0, quiet=True)
    out, png = tmp_path / "fit.json", tmp_path / "fit.png"
    argv = ["fit", "--model", "tests.cli_models:mlp", "--input-shape", "2,64,64", "--memory", "2MiB",
            "--range", "2:16", "--steps", "1", "--quiet", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "largest batch" in text and "| jaxremat |" in text
    saved = json.loads(out.read_text())
    assert {r["strategy"] for r in saved["rows"]} >= {"no remat", "remat every block", JAXREMAT}
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["fit", "--model", "gpt", "--memory", "1GiB", "--axis", "depth"]) == 2
    assert "--axis 'depth'" in capsys.readouterr().err


def test_the_cli_fits_the_strategies_a_user_writes(capsys):
    """``--model PKG.MODULE:FACTORY`` giving name -> make(size) -> (loss, args): the user's own
    hand strategies, each bisected as the built-in ones are, jaxremat planning "no remat"."""
    argv = ["fit", "--model", "tests.cli_models:mlp_strategies", "--memory", "2MiB", "--range", "2:16", "--steps", "0",
            "--quiet"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| my dots_saveable |" in text and "| jaxremat |" in text and "| no remat |" in text
    assert main(["fit", "--model", "tests.cli_models:not_strategies", "--memory", "2MiB"]) == 2
    assert "'no remat' among them" in capsys.readouterr().err


def test_jr_fit_takes_a_model_and_its_input_shape():
    with pytest.raises(ValueError, match="input_shape"):
        jr.fit(mlp(), "1GiB")
    with pytest.raises(ValueError, match="axis"):
        jr.fit(mlp(), "1GiB", input_shape=(2, 4), axis="depth")
    result = jr.fit(mlp(), jr.Device("8MiB", headroom=0.0), input_shape=(2, 8, 64), sizes=(2, 3), steps=0, quiet=True)
    assert result.axis == "batch" and result.row(JAXREMAT).size == 3
