"""Run by tests/test_spmd.py in a subprocess with 8 CPU devices: plans on a data-parallel and a
tensor-parallel mesh, checked against the plain step; prints one JSON line of findings."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxremat as jr  # noqa: E402
from jaxremat.model.chain import Chain  # noqa: E402


class Block(nn.Module):
    """A transformer block: self-attention (4 heads) and a 4x MLP, each with a residual."""

    width: int

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(h, h)
        h = nn.gelu(nn.Dense(4 * self.width, name="up")(nn.LayerNorm()(x)))
        return x + nn.Dense(self.width, name="down")(h)


def collectives(compiled) -> dict[str, int]:
    text = compiled.as_text()
    return {k: len(re.findall(rf"\b{k}(-start)?\(", text)) for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")}


def no_resharding(got: dict[str, int], plain: dict[str, int]) -> bool:
    """No collective the plain step lacks, and no more all-gathers, reduce-scatters or
    all-to-alls than it has. All-reduces may be more: a recomputed tensor-parallel forward repeats
    its all-reduce, and the regions' barriers keep XLA from combining gradient all-reduces across
    them."""
    return all(plain[k] > 0 or got[k] == 0 for k in got) and all(
        got[k] <= plain[k] for k in ("all-gather", "reduce-scatter", "all-to-all")
    )


def place(variables, mesh: Mesh, tensor: bool):
    """Parameters replicated (data parallel), or (tensor parallel, Megatron-style) the attention
    heads and the MLP's hidden units split over ``model``."""

    def spec(path, leaf):
        keys = jax.tree_util.keystr(path)
        if tensor and any(f"'{n}'" in keys for n in ("query", "key", "value")):
            return NamedSharding(mesh, P(None, "model", None) if "kernel" in keys else P("model", None))
        if tensor and "'out'" in keys and "kernel" in keys:
            return NamedSharding(mesh, P("model", None, None))
        if tensor and "up" in keys and "kernel" in keys:
            return NamedSharding(mesh, P(None, "model"))
        if tensor and "up" in keys and "bias" in keys:
            return NamedSharding(mesh, P("model"))
        if tensor and "down" in keys and "kernel" in keys:
            return NamedSharding(mesh, P("model", None))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(lambda p, x: jax.device_put(x, spec(p, x)), variables)


def run(name: str, mesh: Mesh, tensor: bool) -> dict:
    net = nn.Sequential([Block(64) for _ in range(6)])
    x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 32, 64)), NamedSharding(mesh, P("data")))
    v = place(net.init(jax.random.key(0), x), mesh, tensor)
    loss = lambda apply: (lambda v, x: jnp.mean(apply(v, x) ** 2))  # noqa: E731
    plain = jax.jit(jax.value_and_grad(loss(net.apply))).lower(v, x).compile(jr.compiler_options())
    ref = plain(v, x)
    costs = jr.profile(Chain.from_linen(net), v, x, method="xla", cache=False, quiet=True)
    rows = []
    for budget in ("30%", "50%", "75%"):
        model = jr.remat_chain(budget, method="xla")(net)
        plan = jr.plan(model, v, x, costs=costs)
        step = jr.jit(jax.value_and_grad(loss(model.apply)))
        compiled = step.lower(v, x).compile()
        got = compiled(v, x)
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        rows.append(dict(budget=budget, predicted=plan.schedule.peak, temp=int(compiled.memory_analysis().temp_size_in_bytes),
                         err=err, no_resharding=no_resharding(collectives(compiled), collectives(plain)),
                         collectives=collectives(compiled), plain_collectives=collectives(plain),
                         recomputes=any(d.recomputed for d in plan.schedule.decisions())))
    fn = jr.remat(loss(net.apply), "50%", method="xla")
    planned = fn.plan(v, x)  # from the sharded arrays, outside jit: per device
    got = jr.jit(jax.value_and_grad(fn))(v, x)
    remat_fn = dict(err=max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref))),
                    per_device=planned.costs.devices == 8 and "per device" in planned.report())
    x_global = int(np.prod(x.shape)) * 4
    one = jr.profile(Chain.from_linen(net), jax.device_get(v), np.asarray(x), method="xla", cache=False, quiet=True)
    between = (jr.store_all_peak(costs) + jr.store_all_peak(one)) // 2  # above per-device store-all, below the global
    loose = jr.plan(jr.remat_chain(between, method="xla")(net), v, x, costs=costs)
    return dict(name=name, rows=rows, remat_fn=remat_fn, x1=int(costs.x[1]), x_global=x_global, store_all=jr.store_all_peak(costs),
                global_store_all=jr.store_all_peak(one),
                between=between, between_recomputes=any(d.recomputed for d in loose.schedule.decisions()),
                report="per device" in loose.report())


def main() -> None:
    devices = np.array(jax.devices())
    assert len(devices) == 8, devices
    out = [run("data parallel", Mesh(devices, ("data",)), False),
           run("tensor parallel", Mesh(devices.reshape(2, 4), ("data", "model")), True)]
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
