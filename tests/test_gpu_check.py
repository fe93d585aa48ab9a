"""The GPU check stays runnable: its tiny sizes run on the CPU and print the table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402


def test_gpu_check_runs_tiny_and_prints_a_table(capsys, monkeypatch):
    # two of the hand strategies (each compiles twice: itself, and jaxremat at its memory) and the
    # sqrt(L) one; the script's other paths (offload plans, the stacked GPT) run as on a GPU
    monkeypatch.setattr(gpu_check, "MANUAL", ("no remat", "remat every block"))
    monkeypatch.setattr(gpu_check, "FIT_STRATEGIES", ("no remat", "remat every block"))
    monkeypatch.setattr(gpu_check, "FIT_SIZES", ((1, 64), (1, 3)))
    text = gpu_check.main(["--tiny", "--calls", "1", "--no-write", "--only", "GPT"])
    rows = [line for line in text.splitlines() if line.startswith("| GPT-style tiny")]
    assert len(rows) >= 6  # the manual strategies, jaxremat at their memory, the stacked model's
    assert any("no remat" in r for r in rows) and "peak_bytes_in_use" in text
    assert any("jaxremat at 'remat every block'" in r for r in rows) and any("stacked" in r for r in rows)
    assert "the largest batch in" in text and "| jaxremat |" in text  # the fit's table, after the main one
