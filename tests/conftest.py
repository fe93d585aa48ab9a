"""Shared strategies and settings for the solver tests."""

from __future__ import annotations

import os

# LLVM's code generation at -O0: the suite compiles some 2,000 programs and runs each a few
# times, and this cuts its compile time by about a third. The flag reaches only LLVM (XLA's CPU
# compiler maps it to the codegen opt level); HLO passes, buffer assignment and so every memory
# figure a test checks are the same (benchmarks, which time steps, do not set it). Read when the
# backend starts, so set before any test touches a device; child processes inherit it.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import jaxremat as jr

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("JAXREMAT_EXAMPLES", 50)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


@st.composite
def chains(draw, min_len: int = 1, max_len: int = 9, v2: bool = False) -> jr.ChainCosts:
    """Random heterogeneous chains: varied x, xbar up to 20x x, zero temps, tiny sizes. With
    ``v2``, also measured-looking ``FB`` costs (cheaper than ``Fall; B``, or not), up to two
    store options per stage (keeping less, backward slower), and on some chains output bytes the
    backwards do not read (``unread``)."""
    L = draw(st.integers(min_len, max_len))
    scale = draw(st.sampled_from([1, 10, 1000, 10**6]))
    size = st.integers(0, 20).map(lambda v: v * scale)
    x = draw(st.lists(size, min_size=L + 1, max_size=L + 1))
    big = draw(st.booleans())
    xbar = [x[i + 1] * (draw(st.integers(1, 20)) if big else 1) + draw(size) for i in range(L)]
    zero_tmp = draw(st.booleans())
    tmp = st.just(0) if zero_tmp else size
    ftmp = [draw(tmp) for _ in range(L)]
    btmp = [draw(tmp) for _ in range(L)]
    t = st.floats(0.0, 10.0, allow_nan=False).map(lambda v: round(v, 3))
    fwd = [draw(t) for _ in range(L)]
    bwd = [draw(t) for _ in range(L)]
    if not v2:
        return jr.ChainCosts(x=x, xbar=xbar, fwd=fwd, bwd=bwd, fwd_tmp=ftmp, bwd_tmp=btmp)
    share = st.floats(0.0, 1.5, allow_nan=False)
    fb = [round((fwd[i] + bwd[i]) * draw(share), 3) for i in range(L)]
    fb_tmp = [int(draw(share) * xbar[i]) + draw(tmp) for i in range(L)]
    # output bytes a backward does not read (B's need below its bundle's), on some chains
    unread = draw(st.booleans())
    part = lambda most: draw(st.integers(0, most)) if unread else 0  # noqa: E731
    options = []
    for i in range(L):
        n = draw(st.integers(0, 2))
        kept = [int(draw(share) * xbar[i]) for _ in range(n)]
        options.append(
            [
                jr.StageOption(
                    f"policy{k}", kept[k], round(bwd[i] + draw(t), 3), draw(tmp), unread=part(min(kept[k], x[i + 1]))
                )
                for k in range(n)
            ]
        )
    return jr.ChainCosts(
        x=x,
        xbar=xbar,
        fwd=fwd,
        bwd=bwd,
        fwd_tmp=ftmp,
        bwd_tmp=btmp,
        fb=fb,
        fb_tmp=fb_tmp,
        options=options,
        unread=[part(min(xbar[i], x[i + 1])) for i in range(L)],
    )


def random_chain(rng: np.random.Generator, L: int) -> jr.ChainCosts:
    return jr.ChainCosts(
        x=rng.integers(1, 100, L + 1),
        xbar=rng.integers(1, 400, L),
        fwd=rng.uniform(0.5, 3, L),
        bwd=rng.uniform(1, 6, L),
        fwd_tmp=rng.integers(0, 30, L),
        bwd_tmp=rng.integers(0, 30, L),
    )


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def _shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jaxremat-cache")


@pytest.fixture(autouse=True)
def _test_cache(request, tmp_path, monkeypatch, _shared_cache):
    """A profile cache folder of the test run's own (never the user's): shared by the tests, whose
    models repeat (entries are keyed by what they measure), except the profiler's tests, which
    count what is measured and get one folder each."""
    private = request.module.__name__.endswith("test_profile")
    monkeypatch.setenv("JAXREMAT_CACHE_DIR", str(tmp_path / "jaxremat-cache" if private else _shared_cache))


def plain_forward(chain):
    """``f(variables, x, rngs) -> (out, updates)``: ``chain`` stage by stage with plain autodiff,
    each stage's keys folded from the step's as the executor folds them (the reference)."""
    from jaxremat.model.stage import stage_rngs

    def f(variables, x, rngs):
        per, a, updates = chain.split(variables), x, {}
        for i, stage in enumerate(chain.stages):
            a, new = stage.apply(per[i], a, stage_rngs(rngs, i))
            if new:
                updates[i] = new
        return a, updates

    return f


class TanhDense(nn.Module):
    """``tanh(x @ w)``: a stage whose kernel is a quarter of its activation's size at batch 128,
    width 64 (where a kernel copy or a packing hole shows)."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(64, use_bias=False)(x))


class Noisy(nn.Module):
    """A stage with every kind of state: parameters, batch statistics and dropout."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=False)(x)
        return nn.Dropout(0.3, deterministic=False)(nn.tanh(x))


# Seconds each test file took (2026-12-05, the suite's two workers on this 2-core machine; files
# of 30 s or less left out): the files go to the workers longest first, so that the run does
# not end with one worker on a long file while the other waits (the suite's wall time is what CI
# limits). xdist's own order (``--loadscope-reorder``: most tests first) put the one-test
# tensor-parallel file last. A file not listed counts 30 s.
FILE_SECONDS = {
    "test_fidelity.py": 375,
    "test_remat_fn.py": 210,
    "test_spmd.py": 140,
    "test_outside.py": 135,
    "test_cli.py": 135,
    "test_offload_execute.py": 130,
    "test_repeat.py": 125,
    "test_execute.py": 120,
    "test_spmd_tensor.py": 90,
    "test_profile.py": 85,
    "test_gpu_check.py": 70,
    "test_compare.py": 65,
    "test_options.py": 55,
    "test_calibrate.py": 35,
    "test_offload.py": 35,
    "test_exhaustive.py": 35,
}


def pytest_collection_modifyitems(config, items):
    """Longest files first (see ``FILE_SECONDS``), each file's tests in their written order."""
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda item: (-FILE_SECONDS.get(item.path.name, 30), str(item.path), order[id(item)]))
