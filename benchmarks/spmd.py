"""Plans under meshes: per-device predicted peak against XLA's per-device temp, and compiled
flops against the prediction, on 8 simulated CPU devices.

Two meshes over 8 devices: data parallel (batch over 8) and tensor parallel (each block's
attention heads and MLP hidden units over a ``model`` axis of 4, batch over 2), 6 transformer
blocks, budgets 30/50/75/100% of the per-device store-all peak. Writes ``benchmarks/results/spmd.md``.

    python benchmarks/spmd.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import datetime  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from spmd_child import KINDS, Block, collectives, place, recomputed_forwards  # noqa: E402

import flax.linen as nn  # noqa: E402

import jaxremat as jr  # noqa: E402
from jaxremat.core.simulator import predicted_flops  # noqa: E402
from jaxremat.model.chain import Chain  # noqa: E402


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def rows_for(name: str, mesh: Mesh, tensor: bool) -> list[str]:
    net = nn.Sequential([Block(128) for _ in range(6)])
    x = jax.device_put(jax.random.normal(jax.random.key(1), (128, 64, 128)), NamedSharding(mesh, P("data")))
    v = place(net.init(jax.random.key(0), x), mesh, tensor)
    loss = lambda apply: lambda v, x: jnp.mean(apply(v, x) ** 2)  # noqa: E731
    plain = jax.jit(jax.value_and_grad(loss(net.apply))).lower(v, x).compile(jr.compiler_options())
    costs = jr.profile(Chain.from_linen(net), v, x, method="xla", cache=False, quiet=True)
    base_flops = predicted_flops(costs, jr.solve(costs, None, algorithm="store_all").ops)
    out = []
    for budget in ("30%", "50%", "75%", "100%"):
        model = jr.remat_chain(budget, method="xla")(net)
        plan = jr.plan(model, v, x, costs=costs)
        compiled = jr.jit(jax.value_and_grad(loss(model.apply))).lower(v, x).compile()
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
        predicted = predicted_flops(costs, plan.schedule.ops)
        got, base = collectives(compiled), collectives(plain)
        out.append(
            f"| {name} | {budget} | {jr.format_bytes(plan.schedule.peak)} | {jr.format_bytes(temp)} | "
            f"{temp / plan.schedule.peak:.2f} | {flops(compiled) / flops(plain):.3f} | {predicted / base_flops:.3f} | "
            f"{got['all-reduce']['count']} (plain {base['all-reduce']['count']}) | "
            f"{jr.format_bytes(got['all-reduce']['bytes'])} (plain {jr.format_bytes(base['all-reduce']['bytes'])}) | "
            f"{recomputed_forwards(plan.schedule.ops)} | "
            f"{sum(got[k]['bytes'] for k in KINDS if k != 'all-reduce')} |"
        )
        print(out[-1], flush=True)
    return out


def main() -> None:
    devices = np.array(jax.devices())
    lines = [
        "# Plans under meshes (8 CPU devices)",
        "",
        f"Measured {datetime.date.today().isoformat()}, jax {jax.__version__}, "
        "`--xla_force_host_platform_device_count=8`, `cse_barrier_expander` disabled; 6 transformer blocks "
        '(width 128, 4 heads, MLP 512) on a batch of 128 x 64 tokens; profiles with `method="xla"`. Every size is per '
        "device. Command: `python benchmarks/spmd.py`",
        "",
        "| mesh | budget | predicted peak | XLA temp | temp / predicted | compiled flops over plain | predicted "
        "flops over "
        "store-all | all-reduces | all-reduced bytes | recomputed forwards | bytes of other collectives |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += rows_for("data parallel (batch over 8)", Mesh(devices, ("data",)), False)
    lines += rows_for("tensor parallel (model 4, batch 2)", Mesh(devices.reshape(2, 4), ("data", "model")), True)
    lines += [
        "",
        "Each stage's programs are compiled with the shardings of its inputs, parameters and residuals (as the "
        "forward lays them out), so sizes and flops are per device. The all-reduced bytes are the plain step's, "
        "plus, tensor parallel, what a recomputed block's forward all-reduces again; no other collective is added. "
        "There are more all-reduces than in the plain step: the regions' barriers keep XLA from combining the "
        "gradients' all-reduces across them into one. On small models XLA can keep activations in the replicated "
        "parameter-gradient buffers not yet written (outside `temp_size_in_bytes`), and temp falls below the plan.",
    ]
    out = Path(__file__).resolve().parent / "results" / "spmd.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
