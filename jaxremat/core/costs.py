"""The chain cost model of ``docs/cost_model.md``: sizes, times and temporaries per stage."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxremat.core.cost_table import cost_table
from jaxremat.core.options import STORE_ALL, StageOption, check_options
from jaxremat.core.shared import Shared, check_shared
from jaxremat.core.units import format_bytes

# What each array of the cost record is, as field metadata: the one description that validation,
# equality, serialisation and the hash read (a new array is one field here, nothing else).
#   per:     "activation" (L + 1 entries, a_0 .. a_L) or "stage" (L entries)
#   bytes:   whole numbers (int64) or any number (float64)
#   absent:  "required"; "none" (stays None: unknown); "zeros"; "derived" (:data:`_DERIVED`)
#   since:   the contract version (docs/cost_model.md) that added it


def _array(per: str, whole: bool, absent: str, since: int = 1, **kw: Any) -> Any:
    meta = {"per": per, "bytes": whole, "absent": absent, "since": since}
    return (
        dataclasses.field(metadata=meta, **kw)
        if absent == "required"
        else dataclasses.field(default=None, metadata=meta, **kw)
    )


#: An array left out: what ``Fall i; B i`` costs (contract version 1)
_DERIVED = {
    "fb": lambda c: c.fwd + c.bwd,
    "fb_tmp": lambda c: c.xbar + np.maximum(c.fwd_tmp - c.x[:-1], c.bwd_tmp),
}


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

    x: np.ndarray = _array("activation", True, "required")
    xbar: np.ndarray = _array("stage", True, "required")
    fwd: np.ndarray = _array("stage", False, "required")
    bwd: np.ndarray = _array("stage", False, "required")
    fwd_tmp: np.ndarray = _array("stage", True, "required")
    bwd_tmp: np.ndarray = _array("stage", True, "required")
    names: tuple[str, ...] | None = None
    fwd_flops: np.ndarray | None = _array("stage", False, "none")  # from XLA's cost analysis
    bwd_flops: np.ndarray | None = _array("stage", False, "none")
    fwd_bytes: np.ndarray | None = _array("stage", False, "none")
    bwd_bytes: np.ndarray | None = _array("stage", False, "none")
    fb_flops: np.ndarray | None = _array("stage", False, "none")
    fb: np.ndarray | None = _array("stage", False, "derived", since=2)  # the fused forward-backward
    fb_tmp: np.ndarray | None = _array("stage", True, "derived", since=2)
    options: tuple[tuple[StageOption, ...], ...] | None = None
    devices: int = 1  # > 1: the sizes are per device, of a program partitioned over that many
    shared: tuple[Shared, ...] = ()
    held: np.ndarray | None = _array("stage", True, "zeros", since=5)
    fb_reuse: np.ndarray | None = _array("stage", True, "zeros", since=6)
    unread: np.ndarray | None = _array("stage", True, "zeros", since=7)

    def __post_init__(self) -> None:
        xbar = _as_array("xbar", self.xbar, integral=True)
        n = len(xbar)
        if n == 0:
            raise ValueError("ChainCosts describes an empty chain: xbar has no entries; a chain needs >= 1 stage")
        x = _as_array("x", self.x, integral=True)
        if len(x) != n + 1:
            raise ValueError(
                f"ChainCosts.x has {len(x)} entries but xbar has {n}: x needs L+1 = {n + 1} "
                "(one per activation a_0..a_L)"
            )
        derived = []
        for f in array_fields():
            value, meta = getattr(self, f.name), f.metadata
            if value is None:
                if meta["absent"] == "derived":
                    derived.append(f)
                if meta["absent"] != "zeros":
                    continue
                value = np.zeros(n, np.int64)
            arr = _as_array(f.name, value, integral=meta["bytes"])
            want = n + 1 if meta["per"] == "activation" else n
            if len(arr) != want:
                raise ValueError(f"ChainCosts.{f.name} has {len(arr)} entries; expected L = {n} (one per stage)")
            object.__setattr__(self, f.name, arr)
        for f in derived:  # from the arrays above
            object.__setattr__(self, f.name, _as_array(f.name, _DERIVED[f.name](self), integral=f.metadata["bytes"]))
        if self.names is not None:
            names = tuple(str(s) for s in self.names)
            if len(names) != n:
                raise ValueError(f"ChainCosts.names has {len(names)} entries; expected L = {n}")
            object.__setattr__(self, "names", names)
        object.__setattr__(self, "options", check_options(self.options, n))
        object.__setattr__(self, "shared", check_shared(self.shared, self.x))
        for i in np.flatnonzero(self.unread > np.minimum(self.xbar, self.x[1:])):
            raise ValueError(
                f"ChainCosts.unread[{i}] = {self.unread[i]} is more than stage {i}'s output or bundle "
                f"(x[{i + 1}] = {self.x[i + 1]}, xbar[{i}] = {self.xbar[i]}): "
                "it counts output bytes the backward does not read"
            )
        for i, per in enumerate(self.options or ()):
            for k, o in enumerate(per):
                if o.unread > self.x[i + 1]:
                    raise ValueError(
                        f"ChainCosts.options[{i}][{k}] ({o.name}): unread = {o.unread} is more than stage "
                        f"{i}'s output (x[{i + 1}] = {self.x[i + 1]})"
                    )
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
        return hash(tuple(a.tobytes() for f in array_fields() if (a := getattr(self, f.name)) is not None))

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
            return StageOption(
                STORE_ALL, int(self.xbar[i]), float(self.bwd[i]), int(self.bwd_tmp[i]), unread=int(self.unread[i])
            )
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
        """Plain lists (JSON-ready); arrays that are unknown, or zeros by default, left out."""
        d: dict[str, Any] = {}
        for f in array_fields():
            value = getattr(self, f.name)
            if value is not None and (f.metadata["absent"] != "zeros" or value.any()):
                d[f.name] = value.tolist()
        if self.names is not None:
            d["names"] = list(self.names)
        if self.options is not None:
            d["options"] = [[dataclasses.asdict(o) for o in per] for per in self.options]
        if self.devices != 1:
            d["devices"] = self.devices
        if self.shared:
            d["shared"] = [dataclasses.asdict(v) for v in self.shared]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ChainCosts":
        arrays = array_fields()
        missing = [f.name for f in arrays if f.metadata["absent"] == "required" and f.name not in d]
        if missing:
            raise ValueError(f"ChainCosts.from_dict: missing field(s) {missing}")
        return cls(
            **{f.name: d.get(f.name) for f in arrays},
            names=d.get("names"),
            options=d.get("options"),
            devices=int(d.get("devices", 1)),
            shared=d.get("shared", ()),
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
        forward and backward GFLOP, and where any the output bytes a backward does not read
        (:func:`~jaxremat.core.cost_table.cost_table`)."""
        return cost_table(self, time_unit)

    def stage_name(self, i: int) -> str:
        return self.names[i] if self.names is not None else f"stage {i}"


def array_fields() -> tuple[dataclasses.Field, ...]:
    """The arrays of :class:`ChainCosts`, with their metadata (``per``, ``bytes``, ``absent``,
    ``since``), required ones first."""
    return tuple(f for f in dataclasses.fields(ChainCosts) if "per" in f.metadata)
