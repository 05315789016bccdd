"""Triton kernels that fuse a decoder layer's small element-wise steps (CUDA; CPU via TRITON_INTERPRET).

- `add_rms_norm`: residual add and RMSNorm in one pass (returns the normed rows and the new residual).
- `rope_write_kv`: RoPE on the q and k heads of a fused qkv projection, with k and v stored straight into
  the paged cache; returns the rotated q.
- `silu_mul`: SwiGLU's silu(gate) * up from a fused gate_up projection.
- `norm_linear`: residual add, RMSNorm and the following projection (q/k/v or gate/up) in one launch,
  for the few rows of a decode or verify step.
- `swiglu_linear`: silu(gate) * up and the down projection in one launch, for the same few rows, optionally
  adding the residual (a layer's whole output in one launch).
- `linear`: a plain projection (the attention output's) for the same few rows.
- `norm_qkv_rope`: `norm_linear` into q/k/v with `rope_write_kv` folded in, for the same few rows.

The two projection kernels are matrix-vector products: each program loads its slice of weight rows, the
input rows and the norm weight at once (one memory round trip) and reduces the products in registers.
That suits the 1-4 rows of a small-batch step, where latency costs more than arithmetic; larger steps
keep cuBLAS. The model's tiles table (`KernelChoices.gemv_tiles`) sets, per padded row count, the output
columns and warps of a program, whether
it reduces the rows one at a time, and how many rows one program holds: a step's rows split into groups
(the grid's second axis) lets steps of 5-32 rows, such as a tree's verify, take the kernels in 1-4-row
programs (`bench/probes/gemv_tiles.py` times candidates in the served step).

Each matches the torch reference in `layer_ops.TorchOps` up to float rounding: the same fp32 math, and
the same rounding points to the model dtype.
"""

from __future__ import annotations

import torch

from mtpserve.modeling import kernel_choices, pdl
from mtpserve.modeling.gemv_tiles import ROW_COUNTS, GemvTiles, padded_rows
from mtpserve.modeling.kv_cache import KVWrite

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without triton
    triton = None


if triton is not None:
    from mtpserve.modeling.pdl import wait_for_inputs

    @triton.jit
    def _add_rms_norm(
        x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, n, eps,
        stride_x, stride_r, stride_o, stride_res,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_r + cols, mask=inside, other=0.0).to(tl.float32)
            s = (x + r).to(res_ptr.dtype.element_ty)
            tl.store(res_ptr + row * stride_res + cols, s, mask=inside)
            x = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rope_write_kv(
        qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        stride_t, stride_cos, stride_q,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        wait_for_inputs(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        i = tl.arange(0, HALF)
        src = qkv_ptr + t * stride_t + h * DIM
        if h < HEADS + KV_HEADS:
            x1 = tl.load(src + i).to(tl.float32)
            x2 = tl.load(src + HALF + i).to(tl.float32)
            c = tl.load(cos_ptr + t * stride_cos + i)
            s = tl.load(sin_ptr + t * stride_cos + i)
            o1 = x1 * c - x2 * s
            o2 = x2 * c + x1 * s
            if h < HEADS:
                dst = q_ptr + t * stride_q + h * DIM
                tl.store(dst + i, o1.to(q_ptr.dtype.element_ty))
                tl.store(dst + HALF + i, o2.to(q_ptr.dtype.element_ty))
            else:
                slot = tl.load(slot_ptr + t).to(tl.int64)
                dst = k_cache_ptr + slot * (KV_HEADS * DIM) + (h - HEADS) * DIM
                tl.store(dst + i, o1.to(k_cache_ptr.dtype.element_ty))
                tl.store(dst + HALF + i, o2.to(k_cache_ptr.dtype.element_ty))
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            d = tl.arange(0, DIM)
            v = tl.load(src + d)
            dst = v_cache_ptr + slot * (KV_HEADS * DIM) + (h - HEADS - KV_HEADS) * DIM
            tl.store(dst + d, v.to(v_cache_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        g = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + n + cols, mask=inside, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (act * u).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rows_in(
        x_ptr, r_ptr, nw_ptr, res_ptr, w_ptr, pid, M, K, eps, stride_x, stride_r, stride_res,
        HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # this program's group of input rows [BLOCK_M, BLOCK_K] in fp32: x (+ residual, stored once by the
        # group's program 0), RMS-normed and rounded to the weight's dtype as the separate kernels round them
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        inside = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=inside, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * stride_r + ks[None, :], mask=inside, other=0.0).to(tl.float32)
            s = (x + r).to(res_ptr.dtype.element_ty)
            first = tl.where(pid == 0, M, 0)
            tl.store(res_ptr + rows[:, None] * stride_res + ks[None, :], s, mask=inside & (rows[:, None] < first))
            x = s.to(tl.float32)
        if HAS_NORM:
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            inv = 1.0 / tl.sqrt(tl.sum(x * x, 1) / K + eps)
            x = (x * inv[:, None] * nw[None, :]).to(w_ptr.dtype.element_ty).to(tl.float32)
        return x

    @triton.jit
    def _tile_indices(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # (program, its group of input rows, input columns, its output columns) of a matrix-vector kernel
        pid = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        return pid, rows, tl.arange(0, BLOCK_K), pid * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def _weight_tile(w_ptr, cols, ks, stride_w, N, K):
        # weight rows `cols` x columns `ks` of a row-major [N, K] weight, zero outside it
        mask = (cols[:, None] < N) & (ks[None, :] < K)
        return tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=mask, other=0.0)

    @triton.jit
    def _matvec(x, w, ROW_LOOP: tl.constexpr):
        # rows x [BLOCK_M, BLOCK_K] (fp32) times a weight tile w [BLOCK_N, BLOCK_K], reduced in registers: all
        # rows in one [BLOCK_M, BLOCK_N, BLOCK_K] product, or with ROW_LOOP one row at a time
        wf = w.to(tl.float32)
        if ROW_LOOP:
            rows = tl.arange(0, x.shape[0])[:, None]
            y = tl.zeros((x.shape[0], w.shape[0]), tl.float32)
            for m in tl.static_range(x.shape[0]):
                xm = tl.sum(tl.where(rows == m, x, 0.0), 0)
                y = tl.where(rows == m, tl.sum(wf * xm[None, :], 1)[None, :], y)
            return y
        return tl.sum(x[:, None, :] * wf[None, :, :], 2)

    @triton.jit
    def _store_rows(y_ptr, y, rows, cols, stride_y, M, N):
        # y [BLOCK_M, BLOCK_N] into the output rows/columns that exist, in the output's dtype
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_linear(
        x_ptr, r_ptr, nw_ptr, w_ptr, y_ptr, res_ptr, M, N, K, eps,
        stride_x, stride_r, stride_w, stride_y, stride_res,
        HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
        ROW_LOOP: tl.constexpr,
    ):  # fmt: skip
        # every load is issued up front (one memory round trip); the product is reduced in registers
        pid, rows, ks, cols = _tile_indices(BLOCK_M, BLOCK_N, BLOCK_K)
        w = _weight_tile(w_ptr, cols, ks, stride_w, N, K)
        wait_for_inputs(PDL)
        x = _rows_in(x_ptr, r_ptr, nw_ptr, res_ptr, w_ptr, pid, M, K, eps, stride_x, stride_r, stride_res,
                     HAS_NORM, HAS_RES, BLOCK_M, BLOCK_K)  # fmt: skip
        _store_rows(y_ptr, _matvec(x, w, ROW_LOOP), rows, cols, stride_y, M, N)

    @triton.jit
    def _norm_qkv_rope(
        x_ptr, r_ptr, nw_ptr, w_ptr, res_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
        M, K, eps, stride_x, stride_r, stride_w, stride_res, stride_cos, stride_q,
        HAS_RES: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr,
        HALF: tl.constexpr, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
        ROW_LOOP: tl.constexpr,
    ):  # fmt: skip
        # each program owns PAIRS rotation pairs (columns j and j + HALF) of one q, k or v head, so it can
        # rotate its own outputs and store them: q to q_ptr, k and v straight into the paged caches. It
        # reads only the first half of each cos/sin row: the tables repeat their halves (cat(freqs, freqs)).
        pid = tl.program_id(0)
        h = pid // (HALF // PAIRS)
        j = (pid % (HALF // PAIRS)) * PAIRS + tl.arange(0, PAIRS)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        c1 = h * DIM + j
        n = (HEADS + 2 * KV_HEADS) * DIM
        w1 = _weight_tile(w_ptr, c1, ks, stride_w, n, K)
        w2 = _weight_tile(w_ptr, c1 + HALF, ks, stride_w, n, K)
        wait_for_inputs(PDL)
        x = _rows_in(x_ptr, r_ptr, nw_ptr, res_ptr, w_ptr, pid, M, K, eps, stride_x, stride_r, stride_res,
                     True, HAS_RES, BLOCK_M, BLOCK_K)  # fmt: skip
        dt = q_ptr.dtype.element_ty
        y1 = _matvec(x, w1, ROW_LOOP).to(dt).to(tl.float32)  # [BLOCK_M, PAIRS]
        y2 = _matvec(x, w2, ROW_LOOP).to(dt).to(tl.float32)
        ok = (rows < M)[:, None] & (j < HALF)[None, :]
        if h < HEADS + KV_HEADS:
            c = tl.load(cos_ptr + rows[:, None] * stride_cos + j[None, :], mask=ok, other=0.0)
            s = tl.load(sin_ptr + rows[:, None] * stride_cos + j[None, :], mask=ok, other=0.0)
            y1, y2 = y1 * c - y2 * s, y2 * c + y1 * s
        if h < HEADS:
            dst = q_ptr + rows[:, None] * stride_q + h * DIM + j[None, :]
            tl.store(dst, y1.to(dt), mask=ok)
            tl.store(dst + HALF, y2.to(dt), mask=ok)
        else:
            slot = tl.load(slot_ptr + rows, mask=rows < M, other=0).to(tl.int64)
            if h < HEADS + KV_HEADS:
                dst = k_cache_ptr + slot[:, None] * (KV_HEADS * DIM) + (h - HEADS) * DIM + j[None, :]
                tl.store(dst, y1.to(k_cache_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + HALF, y2.to(k_cache_ptr.dtype.element_ty), mask=ok)
            else:
                dst = v_cache_ptr + slot[:, None] * (KV_HEADS * DIM) + (h - HEADS - KV_HEADS) * DIM + j[None, :]
                tl.store(dst, y1.to(v_cache_ptr.dtype.element_ty), mask=ok)
                tl.store(dst + HALF, y2.to(v_cache_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _swiglu_linear(
        x_ptr, w_ptr, r_ptr, y_ptr, M, N, K,
        stride_x, stride_w, stride_r, stride_y,
        HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PDL: tl.constexpr, ROW_LOOP: tl.constexpr,
    ):  # fmt: skip
        _, rows, ks, cols = _tile_indices(BLOCK_M, BLOCK_N, BLOCK_K)
        w = _weight_tile(w_ptr, cols, ks, stride_w, N, K)
        wait_for_inputs(PDL)
        inside = (rows[:, None] < M) & (ks[None, :] < K)
        g = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=inside, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + rows[:, None] * stride_x + K + ks[None, :], mask=inside, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(w_ptr.dtype.element_ty).to(tl.float32)
        a = (act * u).to(w_ptr.dtype.element_ty).to(tl.float32)
        y = _matvec(a, w, ROW_LOOP)
        if HAS_RES:
            # rounded as the projection's output, then added as a separate residual add would
            out = (rows[:, None] < M) & (cols[None, :] < N)
            r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=out, other=0.0).to(tl.float32)
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + r
        _store_rows(y_ptr, y, rows, cols, stride_y, M, N)


def available() -> bool:
    """True when triton is importable."""
    return triton is not None


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for rows x [T, d]; without a residual, (norm(x), x)."""
    _need_triton()
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    if residual is None:
        res, r2 = x, x2
    else:
        r2 = residual.reshape(-1, n)
        res = torch.empty_like(x2)
    if x2.shape[0]:
        _add_rms_norm[(x2.shape[0],)](
            x2, r2, weight, out, res, n, eps,
            x2.stride(0), r2.stride(0), out.stride(0), res.stride(0) if residual is not None else 0,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
    return out.view(x.shape), res.view(x.shape)


def _rope_outputs(kv: KVWrite, t: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos/sin as [T, head_dim] rows and an empty q [T, heads, head_dim]; checks the caches' layout."""
    if not (kv.k_cache.is_contiguous() and kv.v_cache.is_contiguous()):
        raise ValueError("the RoPE kernels need contiguous caches")
    q = torch.empty(t, kv.heads, kv.head_dim, dtype=like.dtype, device=like.device)
    d = kv.cos.shape[-1]  # explicit, so that an empty step reshapes too
    return kv.cos.reshape(t, d), kv.sin.reshape(t, d), q


def rope_write_kv(qkv: torch.Tensor, kv: KVWrite) -> torch.Tensor:
    """Rotate q and k of qkv [T, (heads + 2 kv_heads) * head_dim]; store k and v at `kv.slot_mapping` in
    the paged caches; return q [T, heads, head_dim]."""
    _need_triton()
    t = qkv.shape[0]
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    cos, sin, q = _rope_outputs(kv, t, qkv)
    heads, kv_heads, head_dim = kv.heads, kv.kv_heads, kv.head_dim
    on = pdl.active(qkv, pdl.ATTENTION_STEP_ROWS)  # lets the attention after it read its cached keys meanwhile
    if t:
        _rope_write_kv[(t, heads + 2 * kv_heads)](
            qkv, cos, sin, kv.slot_mapping, q, kv.k_cache, kv.v_cache,
            qkv.stride(0), cos.stride(0), q.stride(0),
            HEADS=heads, KV_HEADS=kv_heads, DIM=head_dim, HALF=head_dim // 2, PDL=on, **pdl.launch_args(on),
        )  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] laid out as [gate | up]; returns [T, I]."""
    _need_triton()
    t, two_n = gate_up.shape
    n = two_n // 2
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty(t, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if t:
        _silu_mul[(t, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out


GEMV_MAX_K = 2048  # widest input row the matrix-vector kernels hold in one tile
GEMV_MAX_ROWS = pdl.SMALL_STEP_ROWS  # beyond this, cuBLAS wins (measured on an H200 at git 3de923b)
GEMV_ROWS_CAP = ROW_COUNTS[-1]  # the most rows a tiles table can give the kernels (in groups)


_DEFAULT_TILES = GemvTiles()


def gemv_tiles(rows: int) -> GemvTiles:
    """The tiles the matrix-vector kernels use for `rows` input rows (padded to a power of two)."""
    return kernel_choices.current().gemv_tiles.get(padded_rows(rows), _DEFAULT_TILES)


def gemv_max_rows() -> int:
    """The most rows the matrix-vector kernels take: GEMV_MAX_ROWS, or a larger padded row count the tiles
    table gives tiles (`gemv_tiles.parse_table` lets those only split the rows into groups)."""
    return max(GEMV_MAX_ROWS, max(kernel_choices.current().gemv_tiles, default=0))


def gemv_fits(rows: int, k: int) -> bool:
    """Whether the matrix-vector kernels take `rows` input rows of width k."""
    return 0 < rows <= gemv_max_rows() and k <= GEMV_MAX_K


def gemv_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the matrix-vector kernels take rows x against weight [N, K] (x [M, K], or [M, 2K] for
    SwiGLU): few, narrow enough rows, a weight with contiguous rows, and one dtype for both (the kernels
    round to the weight's dtype)."""
    return gemv_fits(x.shape[0], weight.shape[1]) and weight.stride(-1) == 1 and weight.dtype == x.dtype


def _gemv_launch(m: int, n: int, k: int) -> tuple[tuple[int, int], dict[str, int]]:
    if not gemv_fits(m, k):
        raise ValueError(f"matrix-vector kernels take 1-{gemv_max_rows()} rows of width <= {GEMV_MAX_K}, got {m} x {k}")
    block_k = triton.next_power_of_2(k)
    tiles = gemv_tiles(m)
    block_m = tiles.rows_per_program(m)
    meta = {
        "BLOCK_M": block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": block_k,
        "num_warps": tiles.num_warps(block_k),
        "ROW_LOOP": tiles.row_loop,
    }
    return (triton.cdiv(n, tiles.block_n), triton.cdiv(m, block_m)), meta


def _rows_and_residual(
    x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, residual to read, new-residual output) with unit column stride; without a residual the kernel
    reads and returns x itself."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    if residual is None:
        return x, x, x
    return x, residual if residual.stride(-1) == 1 else residual.contiguous(), torch.empty_like(x)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T for rows x [M, K] and weight [N, K]; for the few rows `gemv_fits` accepts."""
    return _norm_linear_call(x, residual=None, norm_weight=None, eps=0.0, weight=weight)[0]


def norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T, x + residual) for rows x [M, K] and weight [N, K]; without a
    residual, (rms_norm(x) @ weight.T, x). For the few rows `gemv_fits` accepts."""
    return _norm_linear_call(x, residual, norm_weight, eps, weight=weight)


def _norm_linear_call(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _need_triton()
    m, k = x.shape
    n = weight.shape[0]
    if weight.stride(-1) != 1 or weight.dtype != x.dtype:
        raise ValueError("the matrix-vector kernels need a weight with contiguous rows, in the input's dtype")
    grid, meta = _gemv_launch(m, n, k)
    x, r, res = _rows_and_residual(x, residual)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    on = pdl.active(x, gemv_max_rows())
    _norm_linear[grid](
        x, r, weight if norm_weight is None else norm_weight, weight, y, res, m, n, k, eps,
        x.stride(0), r.stride(0), weight.stride(0), y.stride(0), res.stride(0),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, PDL=on, **meta, **pdl.launch_args(on),
    )  # fmt: skip
    return y, res


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """(silu(gate) * up) @ weight.T for gate_up [M, 2K] laid out as [gate | up] and weight [N, K], plus
    `residual` [M, N] when given; for the few rows `gemv_fits` accepts."""
    _need_triton()
    m, two_k = gate_up.shape
    k = two_k // 2
    n = weight.shape[0]
    if weight.stride(-1) != 1 or weight.dtype != gate_up.dtype:
        raise ValueError("the matrix-vector kernels need a weight with contiguous rows, in the input's dtype")
    grid, meta = _gemv_launch(m, n, k)
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    y = torch.empty(m, n, dtype=gate_up.dtype, device=gate_up.device)
    if residual is not None and (residual.shape != y.shape or residual.dtype != y.dtype):
        raise ValueError(f"swiglu_linear's residual must be [{m}, {n}] in {y.dtype}, got {tuple(residual.shape)}")
    r = y if residual is None else residual if residual.stride(-1) == 1 else residual.contiguous()
    on = pdl.active(gate_up, gemv_max_rows())
    _swiglu_linear[grid](
        gate_up, weight, r, y, m, n, k, gate_up.stride(0), weight.stride(0), r.stride(0), y.stride(0),
        HAS_RES=residual is not None, PDL=on, **meta, **pdl.launch_args(on),
    )  # fmt: skip
    return y


def rope_fits(rows: int, k: int, head_dim: int) -> bool:
    """Whether `norm_qkv_rope` takes `rows` input rows of width k with this head size (each program owns
    `gemv_tiles(rows).block_n` output columns: half as many rotation pairs)."""
    return gemv_fits(rows, k) and head_dim % gemv_tiles(rows).block_n == 0


def norm_qkv_rope(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    kv: KVWrite,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_linear` into the [q; k; v] weight, then `rope_write_kv`, in one launch: returns (rotated q
    [M, heads, head_dim], x + residual); k and v go straight into the paged caches. For `rope_fits`."""
    _need_triton()
    m, k = x.shape
    heads, kv_heads, head_dim = kv.heads, kv.kv_heads, kv.head_dim
    tiles = gemv_tiles(m)
    if not rope_fits(m, k, head_dim):
        raise ValueError(f"norm_qkv_rope takes 1-{gemv_max_rows()} rows of width <= {GEMV_MAX_K} and head_dim "
                         f"divisible by {tiles.block_n}, got {m} x {k}, head_dim {head_dim}")  # fmt: skip
    if weight.shape[0] != (heads + 2 * kv_heads) * head_dim or not gemv_takes(x, weight):
        raise ValueError("norm_qkv_rope needs the fused [q; k; v] weight with contiguous rows, in x's dtype")
    x, r, res = _rows_and_residual(x, residual)
    cos, sin, q = _rope_outputs(kv, m, x)
    half, pairs = head_dim // 2, tiles.block_n // 2
    block_k, block_m = triton.next_power_of_2(k), tiles.rows_per_program(m)
    on = pdl.active(x, gemv_max_rows())
    _norm_qkv_rope[((heads + 2 * kv_heads) * (half // pairs), triton.cdiv(m, block_m))](
        x, r, norm_weight, weight, res, cos, sin, kv.slot_mapping, q, kv.k_cache, kv.v_cache,
        m, k, eps, x.stride(0), r.stride(0), weight.stride(0), res.stride(0), cos.stride(0), q.stride(0),
        HAS_RES=residual is not None, HEADS=heads, KV_HEADS=kv_heads, DIM=head_dim, HALF=half, PAIRS=pairs,
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=tiles.num_warps(block_k),
        ROW_LOOP=tiles.row_loop, PDL=on, **pdl.launch_args(on),
    )  # fmt: skip
    return q, res
