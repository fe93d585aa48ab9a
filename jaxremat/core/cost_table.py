"""The cost record as a table (:meth:`ChainCosts.table <jaxremat.core.costs.ChainCosts.table>`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxremat.core.units import format_bytes

if TYPE_CHECKING:
    from jaxremat.core.costs import ChainCosts


def cost_table(c: ChainCosts, time_unit: str = "ms") -> str:
    """Per stage: name, output size, store-all size, temporaries, times (seconds shown in
    ``time_unit``: "s", "ms" or "us"), ``FB``'s time and bytes, the store options, when known
    forward and backward GFLOP, and where any the output bytes a backward does not read."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
    head = [
        "stage",
        "x (out)",
        "xbar",
        "fwd_tmp",
        "bwd_tmp",
        f"fwd {time_unit}",
        f"bwd {time_unit}",
        f"FB {time_unit}",
        "FB tmp",
    ]
    flops = c.fwd_flops is not None and c.bwd_flops is not None
    if flops:
        head += ["fwd GFLOP", "bwd GFLOP"]
    unread = c.unread.any() or any(o.unread for per in c.options or () for o in per)
    if unread:
        head.append("unread")
    if c.options is not None:
        head.append(f"options: xbar / bwd {time_unit} / bwd_tmp" + (" (/ unread)" if unread else ""))
    rows = [head]
    for i in range(c.length):
        row = [
            c.stage_name(i),
            format_bytes(c.x[i + 1]),
            format_bytes(c.xbar[i]),
            format_bytes(c.fwd_tmp[i]),
            format_bytes(c.bwd_tmp[i]),
            f"{scale * c.fwd[i]:.4g}",
            f"{scale * c.bwd[i]:.4g}",
            f"{scale * c.fb[i]:.4g}",
            format_bytes(c.fb_tmp[i]),
        ]
        if flops:
            row += [f"{c.fwd_flops[i] / 1e9:.4g}", f"{c.bwd_flops[i] / 1e9:.4g}"]
        if unread:
            row.append(format_bytes(c.unread[i]))
        if c.options is not None:
            row.append(
                "; ".join(
                    f"{o.name} {format_bytes(o.xbar)} / {scale * o.bwd:.4g} / {format_bytes(o.bwd_tmp)}"
                    + (f" / {format_bytes(o.unread)}" if o.unread else "")
                    for o in c.options[i]
                )
            )
        rows.append(row)
    widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(
        0,
        f"input a_0: {format_bytes(c.x[0])}"
        + (
            f"; made from constants at the step's start, held until each backward: {format_bytes(c.held.sum())}"
            if c.held.any()
            else ""
        ),
    )
    for v in c.shared:
        name = f" {v.name}" if v.name else ""
        lines.append(f"shared{name}: {format_bytes(v.nbytes)} in a_{v.first} .. a_{v.last}")
    return "\n".join(lines)


__all__ = ["cost_table"]
