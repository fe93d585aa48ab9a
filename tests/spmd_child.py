"""Run by tests/test_spmd.py and tests/test_spmd_tensor.py in a subprocess with 8 CPU devices:
plans on a data-parallel or a tensor-parallel mesh, checked against the plain step; prints one
JSON line of findings."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxremat as jr  # noqa: E402
from jaxremat.model.chain import Chain  # noqa: E402
from jaxremat.profiling import Rates  # noqa: E402
from jaxremat.profiling.buffer_dump import shape_bytes  # noqa: E402

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Store options (checkpoint policies) are profiled for the tensor-parallel mesh's Repeat (a block
# under a policy inside a selective loop is the case nearest its bound); the other entry points
# plan without them, which halves their profiles (the suite's time: the main rows' profile took
# 113 s of the data-parallel process's 450 with them).
NO_OPTIONS = ()
#: blocks per model: enough to recompute at 50%, few enough that the 8-device steps
#: compile quickly (with 6, the data-parallel process took 270 s of the suite's wall time)
BLOCKS = 4
_COLLECTIVE = re.compile(rf"=\s*(\(.*?\)|\S+)\s+({'|'.join(KINDS)})(-start)?\(")


class Block(nn.Module):
    """A transformer block: self-attention (4 heads) and a 4x MLP, each with a residual;
    ``hidden``, a sharding the MLP's hidden units are constrained to inside the block."""

    width: int
    hidden: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(h, h)
        h = nn.gelu(nn.Dense(4 * self.width, name="up")(nn.LayerNorm()(x)))
        if self.hidden is not None:
            h = jax.lax.with_sharding_constraint(h, self.hidden)
        return x + nn.Dense(self.width, name="down")(h)


def collectives(compiled) -> dict[str, dict[str, int]]:
    """Per kind of collective in the compiled program: how many, and the bytes they carry."""
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for line in compiled.as_text().splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            out[m.group(2)]["count"] += 1
            out[m.group(2)]["bytes"] += sum(shape_bytes(t) for t in re.findall(r"\w+\[[\d,]*\]", m.group(1)))
    return out


def recomputed_forwards(ops) -> int:
    """How many stage forwards the schedule runs beyond the first pass (``FB`` runs one)."""
    forwards = [op for op in ops if op.kind in ("Fall", "Fck", "Fn", "FB")]
    return len(forwards) - len({op.stage for op in forwards})


def same_collectives(got: dict, plain: dict, recomputed: int, forward_all_reduce: int) -> bool:
    """The plain step's collectives, byte for byte, except that a recomputed forward may repeat
    its own all-reduces (a tensor-parallel block's attention and MLP outputs): all-reduce bytes
    between the plain step's and that plus ``recomputed`` forwards' worth. The number of
    all-reduces may differ: the regions' barriers keep XLA from combining the gradients'
    all-reduces across them into one."""
    extra = got["all-reduce"]["bytes"] - plain["all-reduce"]["bytes"]
    return 0 <= extra <= recomputed * forward_all_reduce and all(
        got[k]["bytes"] == plain[k]["bytes"] for k in KINDS if k != "all-reduce"
    )


def place(variables, mesh: Mesh, tensor: bool):
    """Parameters replicated (data parallel), or (tensor parallel, Megatron-style) the attention
    heads and the MLP's hidden units split over ``model``."""

    def spec(path, leaf):
        keys = jax.tree_util.keystr(path)
        if "'body'" in keys:  # a jr.Repeat's stacked variables: the copies' axis first
            return NamedSharding(mesh, P(None, *one(keys).spec))
        return one(keys)

    def one(keys):
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


def error(got, ref) -> float:
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))


def offloaded(net, v, x, ref, costs) -> dict:
    """A remat + offload plan under the mesh (a bandwidth so high that offloading is free)."""
    model = jr.remat_chain("60%", method="xla", algorithm="optimal_offload", bandwidth=1e12, policies=NO_OPTIONS)(net)
    plan = jr.plan(model, v, x, costs=costs)
    got = jr.jit(jax.value_and_grad(lambda v, x: jnp.mean(model.apply(v, x) ** 2)))(v, x)
    return dict(err=error(got, ref), offloads=len(plan.schedule.offloads))


def repeated(mesh: Mesh, tensor: bool, x) -> dict:
    """The blocks as one ``jr.Repeat`` (a loop over stacked, sharded variables) at 50%."""
    net = nn.Sequential([nn.Dense(64), jr.Repeat(Block(64), BLOCKS)])
    v = place(net.init(jax.random.key(0), x), mesh, tensor)
    loss = lambda apply: lambda v, x: jnp.mean(apply(v, x) ** 2)  # noqa: E731
    plain = jax.jit(jax.value_and_grad(loss(net.apply))).lower(v, x).compile(jr.compiler_options())
    # store options on the tensor-parallel mesh only (see NO_OPTIONS)
    policies = None if tensor else NO_OPTIONS
    model = jr.remat_chain("50%", method="xla", policies=policies)(net)
    plan = jr.plan(
        model,
        v,
        x,
        costs=jr.profile(Chain.from_linen(net), v, x, method="xla", cache=False, quiet=True, policies=policies),
    )
    compiled = jr.jit(jax.value_and_grad(loss(model.apply))).lower(v, x).compile()
    return dict(
        err=error(compiled(v, x), plain(v, x)),
        predicted=plan.schedule.peak,
        devices=plan.costs.devices,
        temp=int(compiled.memory_analysis().temp_size_in_bytes),
        loops=" while(" in compiled.as_text(),
        recomputes=recomputed_forwards(plan.schedule.ops) > 0,
        no_resharding=all(
            collectives(compiled)[k]["bytes"] == collectives(plain)[k]["bytes"] for k in KINDS if k != "all-reduce"
        ),
    )


def nnx_on(mesh: Mesh) -> dict:
    """``remat_nnx`` planned from a sharded model and batch outside jit, then run under nnx.jit."""
    rngs = nnx.Rngs(0)
    widths = (64, 256, 64, 256, 64)
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nnx.Linear(a, b, rngs=rngs), nnx.gelu]
    seq = nnx.Sequential(*layers[:-1])
    nnx.update(seq, jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), nnx.state(seq)))
    x = jax.device_put(jax.random.normal(jax.random.key(2), (256, 64)), NamedSharding(mesh, P("data")))
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    ref = nnx.jit(nnx.value_and_grad(loss))(seq, x)
    model = jr.remat_nnx("50%", method="xla", policies=NO_OPTIONS)(seq)
    plan = model.plan(x)
    got = nnx.jit(nnx.value_and_grad(loss))(model, x)
    return dict(
        err=error(got, ref),
        per_device=plan.costs.devices == 8 and "per device" in plan.report(),
        recomputes=any(d.recomputed for d in plan.schedule.decisions()),
    )


def explicit(devices) -> dict:
    """Planned inside jit, without a plan made first, under ``jax.set_mesh`` with ``Explicit``
    axes: the tracers' types carry the shardings, so the plan is per device."""
    mesh = Mesh(devices, ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    net = nn.Sequential([Block(64) for _ in range(BLOCKS)])
    with jax.set_mesh(mesh):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 32, 64)), NamedSharding(mesh, P("data")))
        v = jax.device_put(net.init(jax.random.key(0), x), NamedSharding(mesh, P()))
        loss = lambda apply: lambda v, x: jnp.mean(apply(v, x) ** 2)  # noqa: E731
        ref = jax.jit(jax.value_and_grad(loss(net.apply)))(v, x)
        model = jr.remat_chain("50%", method="xla", policies=NO_OPTIONS)(net)
        compiled = jr.jit(jax.value_and_grad(loss(model.apply))).lower(v, x).compile()
        got = compiled(v, x)
    (plan,) = model.planner.plans.values()
    return dict(
        err=error(got, ref),
        devices=plan.costs.devices,
        predicted=plan.schedule.peak,
        temp=int(compiled.memory_analysis().temp_size_in_bytes),
    )


def auto_mesh(devices) -> dict:
    """jaxremat.remat planned inside jit under the legacy ``with mesh:`` (``Auto`` axes, whose
    traced values carry no sharding), batch-sharded: jaxremat.jit reads the arguments' shardings,
    so the plan is per device and verified per device; a byte budget under plain jax.jit, where
    nothing shows the shardings, is refused with what to do."""
    mesh = Mesh(devices, ("data",))
    net = nn.Sequential([Block(64) for _ in range(BLOCKS)])
    loss = lambda v, x: jnp.mean(net.apply(v, x) ** 2)  # noqa: E731
    with mesh:
        x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 32, 64)), NamedSharding(mesh, P("data")))
        v = jax.device_put(net.init(jax.random.key(0), x), NamedSharding(mesh, P()))
        ref = jax.jit(jax.value_and_grad(loss))(v, x)
        fn = jr.remat(loss, "50%", method="xla", policies=NO_OPTIONS, rates=Rates(1e10, 1e10))
        compiled = jr.jit(jax.value_and_grad(fn)).lower(v, x).compile()  # planned while traced
        got = compiled(v, x)
        plan = fn.plan(v, x)  # the same layout: the plan made inside jit
        try:
            jax.jit(jax.grad(jr.remat(loss, "1MiB", method="xla", policies=NO_OPTIONS))).lower(v, x)
            refusal = ""
        except ValueError as e:
            refusal = str(e)
    v_ = plan.verification
    return dict(
        err=error(got, ref),
        devices=plan.costs.devices,
        predicted=plan.schedule.peak,
        temp=int(compiled.memory_analysis().temp_size_in_bytes),
        plans=len(fn._prepared),
        measured=None if v_ is None else v_.measured_peak,
        budget=None if v_ is None else v_.budget,
        report=plan.report(),
        refusal=refusal,
    )


def run(name: str, mesh: Mesh, tensor: bool) -> dict:
    # tensor parallel: a sharding constraint inside each block, profiled as part of the stage
    hidden = NamedSharding(mesh, P("data", None, "model")) if tensor else None
    net = nn.Sequential([Block(64, hidden) for _ in range(BLOCKS)])
    x = jax.device_put(jax.random.normal(jax.random.key(1), (64, 32, 64)), NamedSharding(mesh, P("data")))
    v = place(net.init(jax.random.key(0), x), mesh, tensor)
    loss = lambda apply: lambda v, x: jnp.mean(apply(v, x) ** 2)  # noqa: E731
    plain = jax.jit(jax.value_and_grad(loss(net.apply))).lower(v, x).compile(jr.compiler_options())
    ref = plain(v, x)
    block = (
        jax.jit(Block(64, hidden).apply).lower({"params": v["params"]["layers_0"]}, x).compile(jr.compiler_options())
    )
    forward_all_reduce = collectives(block)["all-reduce"]["bytes"]
    costs = jr.profile(Chain.from_linen(net), v, x, method="xla", cache=False, quiet=True, policies=NO_OPTIONS)
    shardings = jax.tree.map(lambda a: a.sharding, (v, x))
    rows = []
    for budget in ("50%",):  # one budget: what is checked (per-device sizes, collectives) is per plan
        model = jr.remat_chain(budget, method="xla", policies=NO_OPTIONS)(net)
        plan = jr.plan(model, v, x, costs=costs)
        step = jr.jit(
            jax.value_and_grad(loss(model.apply)),
            in_shardings=shardings,
            out_shardings=(NamedSharding(mesh, P()), shardings[0]),
        )
        compiled = step.lower(v, x).compile()
        got = compiled(v, x)
        rows.append(
            dict(
                budget=budget,
                predicted=plan.schedule.peak,
                temp=int(compiled.memory_analysis().temp_size_in_bytes),
                err=error(got, ref),
                collectives=collectives(compiled),
                plain_collectives=collectives(plain),
                same_collectives=same_collectives(
                    collectives(compiled),
                    collectives(plain),
                    recomputed_forwards(plan.schedule.ops),
                    forward_all_reduce,
                ),
                recomputes=recomputed_forwards(plan.schedule.ops) > 0,
            )
        )
    # verified per device in auto_mesh; here the plan's layout only
    fn = jr.remat(loss(net.apply), "50%", method="xla", policies=NO_OPTIONS, verify=False)
    planned = fn.plan(v, x)  # from the sharded arrays, outside jit: per device
    got = jr.jit(jax.value_and_grad(fn))(v, x)
    remat_fn = dict(err=error(got, ref), per_device=planned.costs.devices == 8 and "per device" in planned.report())
    x_global = int(np.prod(x.shape)) * 4
    extra = {"repeat": repeated(mesh, tensor, x)}
    if not tensor:  # data parallel only: what does not depend on the mesh's shape
        extra.update(offload=offloaded(net, v, x, ref, costs), nnx=nnx_on(mesh), **between(net, v, x, costs))
    return dict(name=name, rows=rows, remat_fn=remat_fn, x1=int(costs.x[1]), x_global=x_global, **extra)


def between(net, v, x, costs) -> dict:
    """A budget above the per-device store-all peak and below the global one."""
    one = jr.profile(
        Chain.from_linen(net),
        jax.device_get(v),
        np.asarray(x),
        method="xla",
        cache=False,
        quiet=True,
        policies=NO_OPTIONS,
    )  # the store-all peak is option 0's
    budget = (jr.store_all_peak(costs) + jr.store_all_peak(one)) // 2
    loose = jr.plan(jr.remat_chain(budget, method="xla", policies=NO_OPTIONS)(net), v, x, costs=costs)
    return dict(
        store_all=jr.store_all_peak(costs),
        global_store_all=jr.store_all_peak(one),
        between=budget,
        between_recomputes=any(d.recomputed for d in loose.schedule.decisions()),
        report="per device" in loose.report(),
    )


def main(part: str) -> None:
    """``part``: ``"data"`` (the data-parallel mesh and the explicit one) or ``"tensor"``; two
    processes, so that the test suite's two workers run them side by side."""
    devices = np.array(jax.devices())
    assert len(devices) == 8, devices
    if part == "data":
        out = [
            run("data parallel", Mesh(devices, ("data",)), False),
            dict(name="explicit", **explicit(devices)),
            dict(name="auto", **auto_mesh(devices)),
        ]
    elif part == "tensor":
        out = [run("tensor parallel", Mesh(devices.reshape(2, 4), ("data", "model")), True)]
    else:
        raise SystemExit(f"usage: spmd_child.py data|tensor (got {part!r})")
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
