"""The persistent dynamic program's table, filled by one jitted JAX program.

Layout. ``C(s, t)`` (a vector over the memory axis ``m = 0..S``) is stored twice in one array
``A`` of shape ``(Lb + BS, Lb + BK, S + 1)``, in two triangles that do not overlap:

* start-major, upper-left (``p + q <= L``): ``A[s, t - s] = C(s, t)[m]``;
* end-major, lower-right (``p + q >= Lb``): ``A[t, Lb - (t - s)] = C(s, t)[m - x[s]]`` (``inf``
  below ``x[s]``), the value the checkpoint option ``C(m - x[j], j, t)`` reads.

For a segment length ``d``, the checkpoint option of ``(s, t = s + d)`` at split
``j = s + k + 1`` is ``A[s, k] + A[s + d, Lb - d + k + 1] + F[s, k]``: for a block of ``BS``
starts by ``BK`` splits both operands are one rectangular slice, so the fill is a loop over start
blocks (from the end), then over ``d``, then over split blocks, each a fused add-mask-min over a
window of ``MC`` memory values.

Pruning: ``C(s, t)`` is non-increasing in ``m``, so a split costs at least what it costs with
the most memory; wherever the best option found so far is not above that bound for every split of
a block, the block is skipped there. The table is exactly the unpruned one (float32 rounding is
monotone; a test checks it entry by entry). The chain length ``L`` is a traced value and the array is padded to a
size bucket, so chains of similar depth reuse one compiled program.
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxremat.solvers._discretise import SlotChain, base_need, forward_thresholds, forward_times

BS = 8  # start stages per block
BK = 16  # split points per block
BUCKET = 16
MC = 64  # memory values per step of the split search
MPAD = MC  # memory axis padded to a multiple of this


def bucket(L: int) -> int:
    """Padded table size for a chain of ``L`` stages (``>= L + 1``, a multiple of ``BUCKET``)."""
    return max(BUCKET, -(-(L + 1) // BUCKET) * BUCKET)


def _pad(a: np.ndarray, n: int, dtype, fill=0) -> np.ndarray:
    """``a`` padded along its last axis to ``n`` entries of ``fill``."""
    a = np.asarray(a)
    out = np.full((*a.shape[:-1], n), fill, dtype=dtype)
    out[..., : a.shape[-1]] = a
    return out


def prepare(c: SlotChain) -> dict[str, np.ndarray]:
    """Padded inputs of :func:`fill` for the slot chain ``c``."""
    Lb = bucket(c.L)
    nr = Lb + BS
    # store all under option k: Fall s k then B s, in float32 as the fill adds it
    fb = (c.fwd.astype(np.float32)[None, :] + c.bwd.astype(np.float32)).astype(np.float32)
    never = np.int32(c.slots + 1)  # padded stages and options never fit
    return dict(
        S=np.int32(c.slots),
        L=np.int32(c.L),
        m=np.arange(-(-(c.slots + 1) // MPAD) * MPAD, dtype=np.int32),
        x=_pad(c.x, 2 * nr + 2, np.int32),
        xd=_pad(c.xd, 2 * nr + 2, np.int32),
        xbar=_pad(c.xbar, nr + 1, np.int32),
        fwd_tmp=_pad(c.fwd_tmp, nr + 1, np.int32),
        # B s's need in the store-all branch, as the fill computes it from x, xbar and bwd_tmp
        # (its bwd_need: the bundle's unread output is gone), with what is held then
        bwd_tmp=_pad(c.bwd_need + c.held[: c.L + 1][None, :], nr + 1, np.int32),
        fb=_pad(fb, nr + 1, np.float32),
        base_need=_pad(np.minimum(base_need(c), never), nr, np.int32, never),
        base_time=_pad(np.concatenate([fb, c.fb.astype(np.float32)[None, :]]), nr, np.float32, np.inf),
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


def fill(L, m, x, xd, xbar, fwd_tmp, bwd_tmp, fb, base_need, base_time, thr, F, prune: bool = True) -> jax.Array:
    """Fill the table; return ``A`` (see the module docstring for its layout).

    Order: blocks of ``BS`` starts from the chain's end backwards, and for each block the
    segment lengths ``d = 1, 2, ...``. Every entry a segment reads is shorter and starts no
    earlier, so it is done; and a block's rows of the table (the left operands) and the few
    end rows its splits read stay in cache across its ``d`` loop, where a loop over ``d``
    outermost would stream the whole table from memory once per length.
    """
    S1 = m.shape[0]
    K, nr = xbar.shape[0], xbar.shape[1] - 1
    Lb = nr - BS
    s = jnp.arange(nr)
    back = x[s][None, :] + x[s + 1][None, :] + xbar[:, s] + bwd_tmp[:, s]  # what B s needs, per option
    a_idx = jnp.arange(BS)
    b_idx = jnp.arange(BK)
    m_chunk = jnp.arange(MC)

    def put(A, T, at, rows, ok):
        """``A[at] = rows`` and ``T[at] = rows[:, -1]`` (``T`` mirrors the table at the largest m)
        for the rows where ``ok``."""
        col = lax.dynamic_slice(A, (*at, 0), (BS, 1, S1))
        A = lax.dynamic_update_slice(A, jnp.where(ok[:, None, None], rows[:, None, :], col), (*at, 0))
        col = lax.dynamic_slice(T, at, (BS, 1))
        return A, lax.dynamic_update_slice(T, jnp.where(ok[:, None], rows[:, -1:], col), at)

    def store(A, T, s0, d, rows):
        """Write ``C(s, s + d)`` for the starts ``s0 .. s0 + BS - 1`` into both triangles."""
        ss = s0 + a_idx
        ok = ss <= L - d
        A, T = put(A, T, (s0, d), rows, ok)
        # row t = s + d of column Lb - d holds C(s, t) shifted by x[s]
        return put(A, T, (s0 + d, Lb - d), _shift(rows, x[ss], m), ok)

    def segment(s0, d, AT):
        """``C(s, s + d)`` for the block of starts at ``s0``."""
        A, T = AT
        ss = s0 + a_idx
        # store all under option k: Fall s k, then (s+1 .. t) in m - xbar[k, s], then B s.
        rest = lax.dynamic_slice(A, (s0 + 1, d - 1, 0), (BS, 1, S1))[:, 0, :]
        best = jnp.full((BS, S1), jnp.inf, jnp.float32)
        for k in range(K):  # few options: unrolled
            nxt = _shift(rest, xbar[k, ss], m)
            sa_ok = (m[None, :] >= (xd[ss + d + 1] + xbar[k, ss] + fwd_tmp[ss])[:, None]) & (
                m[None, :] >= back[k, ss][:, None]
            )
            best = jnp.minimum(best, jnp.where(sa_ok, fb[k, ss][:, None] + nxt, jnp.inf))
        valid = ss <= L - d

        def block(kb, acc):
            k0 = kb * BK
            kk = k0 + b_idx
            lim = xd[ss + d + 1][:, None] + lax.dynamic_slice(thr, (s0, k0), (BS, BK))
            lim = jnp.where(valid[:, None] & (kk[None, :] < d), lim, jnp.iinfo(jnp.int32).max)
            fs = lax.dynamic_slice(F, (s0, k0), (BS, BK))
            # Prune. The table is non-increasing in m, so a split costs at least its value at the
            # largest m, and float32 rounding is monotone, so that bound holds for the computed
            # sums too. Where the best so far is not above the least bound of the block, no split
            # of the block can change it; past the last m where it is, the block is skipped, and
            # below the least threshold nothing is allowed.
            if prune:
                top_l = lax.dynamic_slice(T, (s0, k0), (BS, BK))
                top_r = lax.dynamic_slice(T, (s0 + d, Lb - d + k0 + 1), (BS, BK))
                least = jnp.where(lim < jnp.iinfo(jnp.int32).max, top_l + top_r + fs, jnp.inf).min(axis=1)
                hi = jnp.max(jnp.where(acc > least[:, None], m[None, :] + 1, 0))
                lo = jnp.minimum(jnp.min(lim), hi)
            else:
                lo, hi = 0, S1

            def chunk(c, acc):
                # windows of MC from lo, the last one moved back to end at S1: taking the
                # minimum twice over an overlap changes nothing
                m0 = jnp.minimum(lo + c * MC, S1 - MC)
                left = lax.dynamic_slice(A, (s0, k0, m0), (BS, BK, MC))
                right = lax.dynamic_slice(A, (s0 + d, Lb - d + k0 + 1, m0), (BS, BK, MC))
                tot = jnp.where(
                    (m0 + m_chunk)[None, None, :] >= lim[:, :, None], left + right + fs[:, :, None], jnp.inf
                )
                cur = lax.dynamic_slice(acc, (0, m0), (BS, MC))
                # splits on the leading axis: XLA emits one vectorised loop fusion for the reduction
                return lax.dynamic_update_slice(acc, jnp.minimum(cur, tot.transpose(1, 0, 2).min(axis=0)), (0, m0))

            return lax.fori_loop(0, (hi - lo + MC - 1) // MC, chunk, acc)

        best = lax.fori_loop(0, (d + BK - 1) // BK, block, best)
        return store(A, T, s0, d, best)

    # d = 0: C(s, s) is the fastest of FB s and Fall s k; B s that fits (s = L: the loss, needs x[L]).
    fits = m[None, None, :] >= base_need[:, :, None]
    base = jnp.where(fits & (s <= L)[None, :, None], base_time[:, :, None], jnp.inf).min(axis=0)
    A = jnp.full((nr, Lb + BK, S1), jnp.inf, jnp.float32)
    A = A.at[:, 0, :].set(base)
    moved = _shift(base, x[s], m)  # C(s, s) in the end-major triangle: row s, column Lb
    A = A.at[:, Lb, :].set(jnp.where((s <= L)[:, None], moved, jnp.inf))
    n_sb = L // BS + 1  # blocks of starts covering 0 .. L

    def start_block(i, AT):
        s0 = (n_sb - 1 - i) * BS
        return lax.fori_loop(1, L - s0 + 1, lambda d, AT: segment(s0, d, AT), AT)

    return lax.fori_loop(0, n_sb, start_block, (A, A[:, :, -1]))[0]


@functools.lru_cache(maxsize=None)
def _compiled(shapes: tuple, prune: bool = True) -> "jax.stages.Compiled":
    """One compiled fill per bucket shape (the jit cache would not take compiler options)."""
    cpu = jax.devices("cpu")[0]
    specs = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(cpu)) for shape, dtype in shapes
    ]
    return jax.jit(functools.partial(fill, prune=prune)).lower(*specs).compile(_CPU_OPTIONS)


def compile_count() -> int:
    """How many table programs have been compiled in this process (one per bucket shape)."""
    return _compiled.cache_info().currsize


_ORDER = ("L", "m", "x", "xd", "xbar", "fwd_tmp", "bwd_tmp", "fb", "base_need", "base_time", "thr", "F")


def table(c: SlotChain, *, prune: bool = True) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Fill the table for ``c``; return it (as a host array, ``[s, t - s, m]`` = ``C(s, t)[m]``
    where ``s + (t - s) <= L``) and the inputs used. ``prune=False`` evaluates every split
    everywhere (for tests: pruning must not change a single entry)."""
    args = prepare(c)
    arrays = [np.asarray(args[k]) for k in _ORDER]
    cpu = jax.devices("cpu")[0]

    def fill_now() -> np.ndarray:
        return np.asarray(_compiled(_shapes(arrays), prune)(*[jax.device_put(a, cpu) for a in arrays]))

    # A solve may run while the caller's step is traced, and under the caller's mesh
    # (``jax.set_mesh``, which JAX forbids changing under a trace and which makes jit refuse a
    # one-device program). Both are thread-local: the table is computed in a thread of its own.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fill_now).result(), args


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
