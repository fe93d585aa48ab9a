"""Plans under a tensor-parallel (Megatron-style) mesh of 8 CPU devices: the checks of
test_spmd.py, in a process of its own (``spmd_child.py tensor``)."""

from __future__ import annotations

import pytest
from test_spmd import check_mesh, run_child


@pytest.fixture(scope="module")
def findings():
    return run_child("tensor")


def test_per_device_plans_match_xla_and_plain_autodiff(findings):
    check_mesh(findings["tensor parallel"])
