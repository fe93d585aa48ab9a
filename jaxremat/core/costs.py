"""The chain cost model of ``docs/cost_model.md``: sizes, times and temporaries per stage."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxremat.core.options import STORE_ALL, StageOption, check_options
from jaxremat.core.shared import Shared, check_shared
from jaxremat.core.units import format_bytes

_SIZE_FIELDS = ("x", "xbar", "fwd_tmp", "bwd_tmp")
FIELDS = ("x", "xbar", "fwd", "bwd", "fwd_tmp", "bwd_tmp")
OPTIONAL_FIELDS = ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "fb_flops")  # from XLA's cost analysis
V2_FIELDS = ("fb", "fb_tmp")  # contract version 2: the fused forward-backward


def _as_array(name: str, values: Any, *, integral: bool) -> np.ndarray:
    try:
        raw = list(values)
    except TypeError:
        raise ValueError(f"ChainCosts.{name} must be a sequence of numbers, got {type(values).__name__}") from None
    out = []
    for i, v in enumerate(raw):
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"ChainCosts.{name}[{i}] is not a number: {v!r}") from None
        if math.isnan(f):
            raise ValueError(f"ChainCosts.{name}[{i}] is NaN; every entry must be a finite number >= 0")
        if math.isinf(f):
            raise ValueError(f"ChainCosts.{name}[{i}] is infinite; every entry must be a finite number >= 0")
        if f < 0:
            raise ValueError(f"ChainCosts.{name}[{i}] is negative ({v!r}); every entry must be >= 0")
        if integral:
            if isinstance(v, (int, np.integer)):
                out.append(int(v))
            elif f != math.floor(f):
                raise ValueError(f"ChainCosts.{name}[{i}] = {v!r} is not a whole number of bytes")
            else:
                out.append(int(f))
        else:
            out.append(f)
    arr = np.array(out, dtype=np.int64 if integral else np.float64)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class ChainCosts:
    """Per-stage costs of a chain of ``L`` stages (see ``docs/cost_model.md``).

    Args:
      x: ``L+1`` sizes in bytes of the activations ``a_0 .. a_L`` (and of their gradients).
      xbar: ``L`` bytes kept when stage ``i`` runs in store-all mode: its residuals plus its
        output ``a_{i+1}``, not its input.
      fwd, bwd: ``L`` forward and backward times (seconds, or any one unit).
      fwd_tmp, bwd_tmp: ``L`` transient bytes while the stage's forward / backward runs.
      names: optional ``L`` stage names for reports.
      fwd_flops, bwd_flops, fwd_bytes, bwd_bytes: optional ``L`` flops and bytes accessed of each
        stage's forward and backward (the profiler fills them from XLA's cost analysis).
      fb_flops: optional ``L`` flops of ``FB i``.
      fb, fb_tmp: ``L`` time and transient bytes of ``FB i``, the stage's forward fused with its
        backward (``fb_tmp`` beyond ``a_i``, ``delta_{i+1}`` and ``delta_i``). Left out, they are
        what ``Fall i; B i`` costs: ``fwd + bwd`` and ``xbar + max(fwd_tmp - x[i], bwd_tmp)``.
      options: per stage, a tuple of :class:`StageOption` (store options ``1 .. K_i - 1``;
        option 0 is store-all, the arrays above); ``None``: no stage has options.
      shared: values that are part of several consecutive activations (:class:`Shared`: a skip
        connection's tensor), each counted once however many of those activations are live.
      held: optional ``L`` bytes that stage ``i``'s backward makes from constants alone (the
        zeros a transposed resize or pooling scatters the input's gradient into): XLA makes
        them at the step's start, so every schedule holds them from then until that backward.
      fb_reuse: optional ``L`` bytes that ``fb_tmp`` saves because ``FB i`` writes an output over
        the incoming cotangent ``delta_{i+1}`` as it dies. XLA does so only where ``FB i`` reads
        that cotangent as the instruction that made it: where this is not zero, the executor
        hands a region's input cotangent to the region before it directly (not through a
        barrier). It changes no prediction.
      unread: optional ``L`` bytes of the output ``a_{i+1}`` (in ``xbar``) that stage ``i``'s
        store-all backward does not read (a ReLU's or a plain convolution's output): XLA frees
        them once stage ``i+1``'s backward (or the loss) has read them, so ``B i`` runs without
        them (options carry their own, :attr:`StageOption.unread`).

    Arrays are stored as read-only numpy arrays (sizes as ``int64``, times as ``float64``).
    """

    x: np.ndarray
    xbar: np.ndarray
    fwd: np.ndarray
    bwd: np.ndarray
    fwd_tmp: np.ndarray
    bwd_tmp: np.ndarray
    names: tuple[str, ...] | None = None
    fwd_flops: np.ndarray | None = None
    bwd_flops: np.ndarray | None = None
    fwd_bytes: np.ndarray | None = None
    bwd_bytes: np.ndarray | None = None
    fb_flops: np.ndarray | None = None
    fb: np.ndarray | None = None
    fb_tmp: np.ndarray | None = None
    options: tuple[tuple[StageOption, ...], ...] | None = None
    devices: int = 1  # > 1: the sizes are per device, of a program partitioned over that many
    shared: tuple[Shared, ...] = ()
    held: np.ndarray | None = None
    fb_reuse: np.ndarray | None = None
    unread: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in FIELDS:
            arr = _as_array(name, getattr(self, name), integral=name in _SIZE_FIELDS)
            object.__setattr__(self, name, arr)
        n = len(self.xbar)
        if n == 0:
            raise ValueError("ChainCosts describes an empty chain: xbar has no entries; a chain needs >= 1 stage")
        if len(self.x) != n + 1:
            raise ValueError(
                f"ChainCosts.x has {len(self.x)} entries but xbar has {n}: x needs L+1 = {n + 1} "
                "(one per activation a_0..a_L)"
            )
        for name in ("fwd", "bwd", "fwd_tmp", "bwd_tmp"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"ChainCosts.{name} has {len(getattr(self, name))} entries; expected L = {n} (one per stage)"
                )
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                arr = _as_array(name, value, integral=False)
                if len(arr) != n:
                    raise ValueError(f"ChainCosts.{name} has {len(arr)} entries; expected L = {n} (one per stage)")
                object.__setattr__(self, name, arr)
        if self.names is not None:
            names = tuple(str(s) for s in self.names)
            if len(names) != n:
                raise ValueError(f"ChainCosts.names has {len(names)} entries; expected L = {n}")
            object.__setattr__(self, "names", names)
        # FB i left out: what Fall i; B i costs (contract version 1)
        fb = self.fwd + self.bwd if self.fb is None else self.fb
        fb_tmp = self.fb_tmp
        if fb_tmp is None:
            fb_tmp = self.xbar + np.maximum(self.fwd_tmp - self.x[:-1], self.bwd_tmp)
        for name, value in (("fb", fb), ("fb_tmp", fb_tmp)):
            arr = _as_array(name, value, integral=name == "fb_tmp")
            if len(arr) != n:
                raise ValueError(f"ChainCosts.{name} has {len(arr)} entries; expected L = {n} (one per stage)")
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "options", check_options(self.options, n))
        object.__setattr__(self, "shared", check_shared(self.shared, self.x))
        for name in ("held", "fb_reuse", "unread"):  # optional per-stage bytes, zeros by default
            value = getattr(self, name)
            arr = np.zeros(n, np.int64) if value is None else _as_array(name, value, integral=True)
            if len(arr) != n:
                raise ValueError(f"ChainCosts.{name} has {len(arr)} entries; expected L = {n} (one per stage)")
            object.__setattr__(self, name, arr)
        for i in np.flatnonzero(self.unread > np.minimum(self.xbar, self.x[1:])):
            raise ValueError(
                f"ChainCosts.unread[{i}] = {self.unread[i]} is more than stage {i}'s output or bundle "
                f"(x[{i + 1}] = {self.x[i + 1]}, xbar[{i}] = {self.xbar[i]}): "
                "it counts output bytes the backward does not read"
            )
        for i, per in enumerate(self.options or ()):
            for k, o in enumerate(per):
                if o.unread > self.x[i + 1]:
                    raise ValueError(f"ChainCosts.options[{i}][{k}] ({o.name}): unread = {o.unread} is more than stage "
                                     f"{i}'s output (x[{i + 1}] = {self.x[i + 1]})")
        for v in self.shared:  # a bundle holds its output's new shared values
            made = v.first - 1
            for k in range(self.option_count(made)):
                o = self.option(made, k)
                if o.xbar < self.new_shared_bytes(made):
                    raise ValueError(
                        f"ChainCosts: stage {made}'s option {k} ({o.name}) keeps {o.xbar} bytes, less than the shared "
                        f"values it makes ({self.new_shared_bytes(made)} bytes, which its bundle holds)"
                    )

    @property
    def length(self) -> int:
        """Number of stages ``L``."""
        return len(self.xbar)

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ChainCosts):
            return NotImplemented
        # every field, so that a new one cannot be left out (arrays by value, ``None`` equal to ``None``)
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, f).tobytes() for f in FIELDS + V2_FIELDS))

    @functools.cached_property
    def held_before(self) -> np.ndarray:
        """``P[n]``: bytes of :attr:`held` of stages ``0 .. n-1`` (``n = 0 .. L+1``; ``P[L+1] =
        P[L]``): what is held while the backward of stage ``n`` runs, or, at ``n = t + 1``, while
        any forward op runs before the backward of stage ``t``."""
        p = np.concatenate([[0], np.cumsum(self.held), [self.held.sum()]]).astype(np.int64)
        p.setflags(write=False)
        return p

    # -- shared values ---------------------------------------------------------------------------

    def shared_in(self, k: int) -> tuple[int, ...]:
        """Indices into :attr:`shared` of the values that are part of ``a_k``."""
        return tuple(n for n, v in enumerate(self.shared) if v.first <= k <= v.last)

    @functools.cached_property
    def shared_pieces(self) -> tuple[tuple[int, ...], ...]:
        """Per activation ``a_0 .. a_L``: :meth:`shared_in` (for the simulator's inner loop)."""
        return tuple(self.shared_in(k) for k in range(self.length + 1))

    def new_shared_bytes(self, i: int) -> int:
        """Bytes of the shared values stage ``i`` makes (part of ``a_{i+1}``, not of ``a_i``)."""
        return int(self.overlap[i + 1, i + 1] - self.overlap[i, i + 1])

    @functools.cached_property
    def overlap(self) -> np.ndarray:
        """``(L+1, L+1)`` bytes that ``a_p`` and ``a_q`` share (``overlap[k, k]``: the shared
        bytes of ``a_k``); all zeros without shared values."""
        n = self.length + 1
        ov = np.zeros((n, n), np.int64)
        for v in self.shared:
            ov[v.first : v.last + 1, v.first : v.last + 1] += v.nbytes
        ov.setflags(write=False)
        return ov

    def without_shared(self) -> "ChainCosts":
        """These costs with every shared value counted in each activation that holds it (what a
        solver that does not model sharing assumes: a safe over-count)."""
        return dataclasses.replace(self, shared=())

    # -- store options ---------------------------------------------------------------------------

    def option_count(self, i: int) -> int:
        """``K_i``: stage ``i``'s store options, store-all (option 0) included."""
        return 1 + (len(self.options[i]) if self.options is not None else 0)

    @property
    def max_options(self) -> int:
        """The largest ``K_i`` over the stages."""
        return max(self.option_count(i) for i in range(self.length))

    def option(self, i: int, k: int) -> StageOption:
        """Stage ``i``'s option ``k`` (option 0 as a :class:`StageOption` named ``"store_all"``)."""
        if not 0 <= k < self.option_count(i):
            raise ValueError(f"stage {i} has {self.option_count(i)} store option(s); there is no option {k}")
        if k == 0:
            return StageOption(STORE_ALL, int(self.xbar[i]), float(self.bwd[i]), int(self.bwd_tmp[i]),
                               unread=int(self.unread[i]))
        return self.options[i][k - 1]

    @functools.cached_property
    def option_table(self) -> tuple[tuple[tuple[int, float, int, int], ...], ...]:
        """Per stage, per option: ``(xbar, bwd, bwd_tmp, unread)`` (for the simulator's inner loop)."""
        options = [[self.option(i, k) for k in range(self.option_count(i))] for i in range(self.length)]
        return tuple(tuple((o.xbar, o.bwd, o.bwd_tmp, o.unread) for o in stage) for stage in options)

    def option_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(K, L)`` arrays of every option's ``xbar``, ``bwd``, ``bwd_tmp``, ``unread`` (``K`` =
        :attr:`max_options`), and a mask of the options that exist (missing ones hold zeros)."""
        K, L = self.max_options, self.length
        xbar, bwd, bwd_tmp = np.zeros((K, L), np.int64), np.zeros((K, L)), np.zeros((K, L), np.int64)
        unread, exists = np.zeros((K, L), np.int64), np.zeros((K, L), bool)
        for i in range(L):
            for k in range(self.option_count(i)):
                o = self.option(i, k)
                xbar[k, i], bwd[k, i], bwd_tmp[k, i], unread[k, i] = o.xbar, o.bwd, o.bwd_tmp, o.unread
                exists[k, i] = True
        return xbar, bwd, bwd_tmp, unread, exists

    def __repr__(self) -> str:
        return (
            f"ChainCosts(L={self.length}, x0={format_bytes(self.x[0])}, "
            f"sum(xbar)={format_bytes(self.xbar.sum())}, "
            f"fwd={self.fwd.sum():.4g}, bwd={self.bwd.sum():.4g})"
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain lists (JSON-ready)."""
        d: dict[str, Any] = {f: getattr(self, f).tolist() for f in FIELDS}
        if self.names is not None:
            d["names"] = list(self.names)
        d.update({f: getattr(self, f).tolist() for f in OPTIONAL_FIELDS if getattr(self, f) is not None})
        d.update({f: getattr(self, f).tolist() for f in V2_FIELDS})
        if self.options is not None:
            d["options"] = [[dataclasses.asdict(o) for o in per] for per in self.options]
        if self.devices != 1:
            d["devices"] = self.devices
        if self.shared:
            d["shared"] = [dataclasses.asdict(v) for v in self.shared]
        if self.held.any():
            d["held"] = self.held.tolist()
        if self.fb_reuse.any():
            d["fb_reuse"] = self.fb_reuse.tolist()
        if self.unread.any():
            d["unread"] = self.unread.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChainCosts":
        missing = [f for f in FIELDS if f not in d]
        if missing:
            raise ValueError(f"ChainCosts.from_dict: missing field(s) {missing}")
        return cls(
            **{f: d[f] for f in FIELDS}, names=d.get("names"), **{f: d.get(f) for f in OPTIONAL_FIELDS + V2_FIELDS},
            options=d.get("options"), devices=int(d.get("devices", 1)), shared=d.get("shared", ()), held=d.get("held"),
            fb_reuse=d.get("fb_reuse"), unread=d.get("unread"),
        )

    @classmethod
    def uniform(
        cls,
        length: int,
        *,
        x: int,
        xbar: int,
        fwd: float = 1.0,
        bwd: float = 2.0,
        fwd_tmp: int = 0,
        bwd_tmp: int = 0,
    ) -> "ChainCosts":
        """A chain of ``length`` identical stages."""
        return cls(
            x=[x] * (length + 1),
            xbar=[xbar] * length,
            fwd=[fwd] * length,
            bwd=[bwd] * length,
            fwd_tmp=[fwd_tmp] * length,
            bwd_tmp=[bwd_tmp] * length,
        )

    def table(self, time_unit: str = "ms") -> str:
        """Per stage: name, output size, store-all size, temporaries, times (seconds shown in
        ``time_unit``: "s", "ms" or "us"), ``FB``'s time and bytes, the store options, when known
        forward and backward GFLOP, and where any the output bytes a backward does not read."""
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
        head = ["stage", "x (out)", "xbar", "fwd_tmp", "bwd_tmp", f"fwd {time_unit}", f"bwd {time_unit}",
                f"FB {time_unit}", "FB tmp"]
        flops = self.fwd_flops is not None and self.bwd_flops is not None
        if flops:
            head += ["fwd GFLOP", "bwd GFLOP"]
        unread = self.unread.any() or any(o.unread for per in self.options or () for o in per)
        if unread:
            head.append("unread")
        if self.options is not None:
            head.append(f"options: xbar / bwd {time_unit} / bwd_tmp" + (" (/ unread)" if unread else ""))
        rows = [head]
        for i in range(self.length):
            row = [
                self.stage_name(i), format_bytes(self.x[i + 1]), format_bytes(self.xbar[i]),
                format_bytes(self.fwd_tmp[i]), format_bytes(self.bwd_tmp[i]),
                f"{scale * self.fwd[i]:.4g}", f"{scale * self.bwd[i]:.4g}",
                f"{scale * self.fb[i]:.4g}", format_bytes(self.fb_tmp[i]),
            ]
            if flops:
                row += [f"{self.fwd_flops[i] / 1e9:.4g}", f"{self.bwd_flops[i] / 1e9:.4g}"]
            if unread:
                row.append(format_bytes(self.unread[i]))
            if self.options is not None:
                row.append("; ".join(
                    f"{o.name} {format_bytes(o.xbar)} / {scale * o.bwd:.4g} / {format_bytes(o.bwd_tmp)}"
                    + (f" / {format_bytes(o.unread)}" if o.unread else "")
                    for o in self.options[i]
                ))
            rows.append(row)
        widths = [max(len(r[k]) for r in rows) for k in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.insert(0, f"input a_0: {format_bytes(self.x[0])}"
                     + (f"; made from constants at the step's start, held until each backward: "
                        f"{format_bytes(self.held.sum())}" if self.held.any() else ""))
        for v in self.shared:
            name = f" {v.name}" if v.name else ""
            lines.append(f"shared{name}: {format_bytes(v.nbytes)} in a_{v.first} .. a_{v.last}")
        return "\n".join(lines)

    def stage_name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"stage {i}"

