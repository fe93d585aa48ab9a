"""The persistent dynamic program's table, filled by one jitted JAX program.

Layout. ``C(s, t)`` (a vector over the memory axis ``m = 0..S``) is stored twice in one array
``A`` of shape ``(Lb + BS, Lb + BK, S + 1)``, in two triangles that do not overlap:

* start-major, upper-left (``p + q <= L``): ``A[s, t - s] = C(s, t)[m]``;
* end-major, lower-right (``p + q >= Lb``): ``A[t, Lb - (t - s)] = C(s, t)[m - x[s]]`` (``inf``
  below ``x[s]``), the value the checkpoint option ``C(m - x[j], j, t)`` reads.

For a segment length ``d``, the checkpoint option of ``(s, t = s + d)`` at split
``j = s + k + 1`` is ``A[s, k] + A[s + d, Lb - d + k + 1] + F[s, k]``: for a block of ``BS``
starts by ``BK`` splits both operands are one rectangular slice, so the fill is a loop over ``d``
and, inside, over blocks, each a fused add-mask-min. The chain length ``L`` is a traced value
and the array is padded to a size bucket, so chains of similar depth reuse one compiled program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat.solvers.discretise import SlotChain, forward_thresholds, forward_times

BS = 8  # start stages per block
BK = 8  # split points per block
BUCKET = 16
MPAD = 16  # memory axis padded to a multiple of this (SIMD-friendly)


def bucket(L: int) -> int:
    """Padded table size for a chain of ``L`` stages (``>= L + 1``, a multiple of ``BUCKET``)."""
    return max(BUCKET, -(-(L + 1) // BUCKET) * BUCKET)


def _pad(a: np.ndarray, n: int, dtype) -> np.ndarray:
    out = np.zeros(n, dtype=dtype)
    out[: len(a)] = a
    return out


def prepare(c: SlotChain) -> dict[str, np.ndarray]:
    """Padded inputs of :func:`fill` for the slot chain ``c``."""
    Lb = bucket(c.L)
    nr = Lb + BS
    fb = (c.fwd.astype(np.float32) + c.bwd.astype(np.float32)).astype(np.float32)
    return dict(
        S=np.int32(c.slots),
        L=np.int32(c.L),
        m=np.arange(-(-(c.slots + 1) // MPAD) * MPAD, dtype=np.int32),
        x=_pad(c.x, 2 * nr + 2, np.int32),
        xbar=_pad(c.xbar, nr + 1, np.int32),
        fwd_tmp=_pad(c.fwd_tmp, nr + 1, np.int32),
        bwd_tmp=_pad(c.bwd_tmp, nr + 1, np.int32),
        fb=_pad(fb, nr + 1, np.float32),
        thr=forward_thresholds(c.x, c.fwd_tmp, nr, Lb + BK).astype(np.int32),
        F=forward_times(c.fwd, nr, Lb + BK).astype(np.float32),
    )


def _shift(rows: jax.Array, by: jax.Array, m: jax.Array) -> jax.Array:
    """``out[r, m] = rows[r, m - by[r]]``, ``inf`` where ``m < by[r]``.

    Each row is one contiguous slice of the row padded on the left with ``inf``: a gather of
    whole rows, several times faster on CPU than gathering element by element.
    """
    n = rows.shape[1]
    padded = jnp.concatenate([jnp.full_like(rows, jnp.inf), rows], axis=1)
    start = n - jnp.clip(by, 0, n)
    return jax.vmap(lambda row, b: lax.dynamic_slice(row, (b,), (n,)))(padded, start)


# The reduction as XLA's own loop fusion (not a YNNPACK call) and min without NaN handling
# (no NaN can occur) measured fastest on CPU; the table is always built on the CPU.
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_enable_fast_min_max": True}


def fill(L, m, x, xbar, fwd_tmp, bwd_tmp, fb, thr, F) -> jax.Array:
    """Fill the table; return ``A`` (see the module docstring for its layout)."""
    S1 = m.shape[0]
    nr = xbar.shape[0] - 1
    Lb = nr - BS
    s = jnp.arange(nr)
    back = x[s] + x[s + 1] + xbar[s] + bwd_tmp[s]  # what B s needs, beyond a_s

    def store(A, d, rows):
        """Write ``C(s, s + d)`` for every valid ``s`` into both triangles (two columns of A)."""
        ok = (s <= L - d)[:, None, None]
        col = lax.dynamic_slice(A, (0, d, 0), (nr, 1, S1))
        A = lax.dynamic_update_slice(A, jnp.where(ok, rows[:, None, :], col), (0, d, 0))
        # row t = s + d of column Lb - d holds C(s, t) shifted by x[s]
        moved = jnp.roll(_shift(rows, x[s], m), d, axis=0)[:, None, :]
        col = lax.dynamic_slice(A, (0, Lb - d, 0), (nr, 1, S1))
        ok = ((s >= d) & (s <= L))[:, None, None]
        return lax.dynamic_update_slice(A, jnp.where(ok, moved, col), (0, Lb - d, 0))

    # d = 0: C(s, s) = fwd + bwd when Fall s and B s fit (s = L: the loss, needs x[L]).
    base_need = jnp.maximum(x[s + 1] + xbar[s] + fwd_tmp[s], back)
    A = jnp.full((nr, Lb + BK, S1), jnp.inf, jnp.float32)
    A = store(A, 0, jnp.where(m[None, :] >= base_need[:, None], fb[s][:, None], jnp.inf))

    a_idx = jnp.arange(BS)
    b_idx = jnp.arange(BK)

    def segment(d, A):
        # store all: Fall s, then (s+1 .. t) in m - xbar[s], then B s.
        col = lax.dynamic_slice(A, (0, d - 1, 0), (nr, 1, S1))[:, 0, :]
        nxt = _shift(jnp.concatenate([col[1:], col[:1]]), xbar[s], m)
        sa_ok = (m[None, :] >= (x[s + d + 1] + xbar[s] + fwd_tmp[s])[:, None]) & (m[None, :] >= back[:, None])
        best = jnp.where(sa_ok, fb[s][:, None] + nxt, jnp.inf)

        n_kc = (d + BK - 1) // BK
        n_blocks = ((L - d + BS) // BS) * n_kc

        def block(q, acc):
            s0 = (q // n_kc) * BS
            k0 = (q % n_kc) * BK
            left = lax.dynamic_slice(A, (s0, k0, 0), (BS, BK, S1))
            right = lax.dynamic_slice(A, (s0 + d, Lb - d + k0 + 1, 0), (BS, BK, S1))
            ss = s0 + a_idx
            kk = k0 + b_idx
            lim = x[ss + d + 1][:, None] + lax.dynamic_slice(thr, (s0, k0), (BS, BK))
            ok = (ss[:, None] <= L - d) & (kk[None, :] < d)
            lim = jnp.where(ok, lim, jnp.iinfo(jnp.int32).max)
            fs = lax.dynamic_slice(F, (s0, k0), (BS, BK))
            tot = jnp.where(m[None, None, :] >= lim[:, :, None], left + right + fs[:, :, None], jnp.inf)
            cur = lax.dynamic_slice(acc, (s0, 0), (BS, S1))
            # splits on the leading axis: XLA emits one vectorised loop fusion for the reduction
            return lax.dynamic_update_slice(acc, jnp.minimum(cur, tot.transpose(1, 0, 2).min(axis=0)), (s0, 0))

        best = lax.fori_loop(0, n_blocks, block, best)
        return store(A, d, best)

    return lax.fori_loop(1, L + 1, segment, A)


@functools.lru_cache(maxsize=None)
def _compiled(shapes: tuple) -> "jax.stages.Compiled":
    """One compiled fill per bucket shape (the jit cache would not take compiler options)."""
    cpu = jax.devices("cpu")[0]
    specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(cpu)) for shape, dtype in shapes]
    return jax.jit(fill).lower(*specs).compile(_CPU_OPTIONS)


def compile_count() -> int:
    """How many table programs have been compiled in this process (one per bucket shape)."""
    return _compiled.cache_info().currsize


_ORDER = ("L", "m", "x", "xbar", "fwd_tmp", "bwd_tmp", "fb", "thr", "F")


def table(c: SlotChain) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Fill the table for ``c``; return it (as a host array, ``[s, t - s, m]`` = ``C(s, t)[m]``
    where ``s + (t - s) <= L``) and the inputs used."""
    args = prepare(c)
    arrays = [np.asarray(args[k]) for k in _ORDER]
    cpu = jax.devices("cpu")[0]
    with jax.ensure_compile_time_eval():  # a solve may run while the caller's step is traced
        A = _compiled(_shapes(arrays))(*[jax.device_put(a, cpu) for a in arrays])
    return np.asarray(A), args


def program(c: SlotChain) -> "jax.stages.Compiled":
    """The compiled table program for ``c``'s size bucket (compiled on first use)."""
    args = prepare(c)
    return _compiled(_shapes([np.asarray(args[k]) for k in _ORDER]))


def _shapes(arrays: list[np.ndarray]) -> tuple:
    return tuple((a.shape, a.dtype) for a in arrays)


def table_bytes(c: SlotChain) -> int:
    """Bytes of the table :func:`table` allocates for ``c``."""
    Lb = bucket(c.L)
    s1 = -(-(c.slots + 1) // MPAD) * MPAD
    return (Lb + BS) * (Lb + BK) * s1 * 4
