"""The profiled cost model against XLA's compiled training step (CPU, remat made real).

Asserted here: the cases that hold within 15% (see benchmarks/results/profile_fidelity.md for
all of them; the MLP and the CNN with every stage checkpointed do not yet, and the issue notes
say why).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_fidelity import models, ratios  # noqa: E402

CASES = {label.split(" ")[0]: (label, chain, x) for label, chain, x in models(scale=4)}


@pytest.mark.parametrize(
    "model,schedules", [("CNN", ("store_all",)), ("Transformer", ("store_all", "every_stage"))]
)
def test_xla_temp_within_15_percent_of_prediction(model, schedules):
    rows = {row[1]: (row[2], row[3]) for row in ratios(*CASES[model])}
    for alg in schedules:
        temp, pred = rows[alg]
        assert 0.85 <= temp / pred <= 1.15, (model, alg, temp, pred)
