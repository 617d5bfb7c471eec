"""Plain-PyTorch references of the two ops the bypass touches.

They follow the fork-era contracts described in DESIGN.md and GPU.md and run
on any device, CPU included:

- ``fused_minimax_m3_qknorm_rope_kv_insert``: Gemma RMSNorm
  ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` then NeoX rotary on the first
  ``rotary_dim`` dims of every q, k, index_q and index_k head. k and index_k
  are rewritten in place in ``qkv``, q and index_q go to ``q_out`` /
  ``index_q_out`` (in place without them); newer builds' ``q_fp8_out`` also
  gets q as saturating e4m3 of ``q / q_fp8_scale`` (their NVFP4 cache scales are
  not modelled), and ``write_qkv=False`` leaves ``qkv`` as it was. With a cache it also scatters k/v
  into ``[num_blocks, 2, block_size, kv_heads, head_dim]`` and index_k by its
  own slots, and - like the fork kernel - it accepts bf16 main caches only. The
  index cache is of the qkv dtype (copied) or float8_e4m3fn (``indexer_kv_dtype``
  "fp8"), where index_k is stored as the forks' kernel stores it: clamped to
  +-448, then converted (saturating, no scale).
- ``reshape_and_cache_flash``: ``"auto"`` copies into a cache of the key's dtype;
  ``"fp8"``/``"fp8_e4m3"`` stores ``x / scale`` as saturating float8_e4m3fn bits
  in a 1-byte cache, uint8 or float8_e4m3fn alike (the real kernel never checks
  the cache's dtype: it writes through the data pointer as bytes). What the real
  op would garble (``"auto"`` into a cache of another dtype) is refused.
"""

from __future__ import annotations

import torch

FP8_DTYPES = ("fp8", "fp8_e4m3")
# The caches an fp8 store writes: 1-byte storage the kernel fills with e4m3 bits.
FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
E4M3_MAX = 448.0
BF16_ONLY = "kv_cache dtype must match qkv (bf16 cache only)"


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Float32 result of the Gemma RMSNorm over the last dim."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf * (1.0 + weight.float())


def neox_rope(x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """NeoX rotary on the first ``rotary_dim`` dims; ``cos_sin`` is ``[tokens, rotary_dim]``."""
    half = rotary_dim // 2
    cos = cos_sin[:, None, :half].float()
    sin = cos_sin[:, None, half:rotary_dim].float()
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def to_e4m3_bits(x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """``x / scale`` as saturating float8_e4m3fn, returned as its uint8 bits."""
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """A 1-byte cache as the uint8 storage the kernels write (a view: writes land in ``cache``)."""
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def e4m3_steps(bits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps (at ``x``'s magnitude) the stored bits are from ``x``."""
    stored = bits.view(torch.float8_e4m3fn).float()
    xf = x.float().clamp(-E4M3_MAX, E4M3_MAX)
    exponent = torch.floor(torch.log2(xf.abs().clamp(min=2.0**-6))).clamp(max=8)
    return (stored - xf).abs() / 2.0 ** (exponent - 3)


def _norm_rope(
    view: torch.Tensor, heads: int, weight: torch.Tensor, eps: float, cos_sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    x = view.reshape(view.shape[0], heads, -1)
    return neox_rope(gemma_rms_norm(x, weight, eps), cos_sin, rotary_dim).to(view.dtype).reshape(view.shape)


def _scatter_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    keep = slots >= 0  # padded tokens carry slot -1 and are skipped
    flat[slots[keep].long()] = rows[keep].to(flat.dtype)


def _scatter_into(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Row ``i`` to slot ``slots[i]`` of a (possibly strided) ``[blocks, block_size, ...]`` cache."""
    num_blocks, bs = cache.shape[:2]
    flat = cache.reshape(num_blocks * bs, -1)  # a view when the cache allows one, else a copy
    _scatter_rows(flat, slots, rows.reshape(rows.shape[0], -1))
    if flat.data_ptr() != cache.data_ptr():
        cache.copy_(flat.view(cache.shape))


def fused_minimax_m3_qknorm_rope_kv_insert(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    eps: float,
    index_q_norm_weight: torch.Tensor | None = None,
    index_k_norm_weight: torch.Tensor | None = None,
    num_index_heads: int = 0,
    slot_mapping: torch.Tensor | None = None,
    index_slot_mapping: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    index_cache: torch.Tensor | None = None,
    block_size: int = 0,
    q_out: torch.Tensor | None = None,
    index_q_out: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    q_fp8_out: torch.Tensor | None = None,
    q_fp8_scale: torch.Tensor | float = 1.0,
    kv_k_scale: torch.Tensor | None = None,
    kv_v_scale: torch.Tensor | None = None,
    write_qkv: bool = True,
) -> None:
    if kv_cache_dtype != "auto" and kv_cache_dtype not in FP8_DTYPES:
        raise NotImplementedError(f"reference op: kv_cache_dtype={kv_cache_dtype!r}")
    if kv_k_scale is not None or kv_v_scale is not None:  # (an NVFP4 cache's)
        raise NotImplementedError("reference op: NVFP4 cache scales")
    head_dim = q_norm_weight.numel()
    q_end = num_heads * head_dim
    k_end = q_end + num_kv_heads * head_dim
    v_end = k_end + num_kv_heads * head_dim
    cos_sin = cos_sin_cache[positions.long()]

    q = _norm_rope(qkv[:, :q_end], num_heads, q_norm_weight, eps, cos_sin, rotary_dim)
    k = _norm_rope(qkv[:, q_end:k_end], num_kv_heads, k_norm_weight, eps, cos_sin, rotary_dim)
    if q_out is not None:
        q_out.copy_(q)
    elif write_qkv:
        qkv[:, :q_end] = q
    if q_fp8_out is not None:  # newer builds: q for an fp8-query attention too
        _bytes(q_fp8_out).copy_(to_e4m3_bits(q, q_fp8_scale).reshape(q_fp8_out.shape))
    if write_qkv:
        qkv[:, q_end:k_end] = k

    index_k = None
    if num_index_heads:
        assert index_q_norm_weight is not None and index_k_norm_weight is not None
        idx_dim = index_q_norm_weight.numel()
        iq_end = v_end + num_index_heads * idx_dim
        index_q = _norm_rope(
            qkv[:, v_end:iq_end], num_index_heads, index_q_norm_weight, eps, cos_sin, rotary_dim
        )
        index_k = _norm_rope(
            qkv[:, iq_end : iq_end + idx_dim], 1, index_k_norm_weight, eps, cos_sin, rotary_dim
        )
        if index_q_out is not None:
            index_q_out.copy_(index_q)
        elif write_qkv:
            qkv[:, v_end:iq_end] = index_q
        if write_qkv:
            qkv[:, iq_end : iq_end + idx_dim] = index_k

    if kv_cache is None:
        return
    # The fork's op writes bf16 main caches only; a native one (kv_cache_dtype passed)
    # also stores k/v as e4m3 (scale 1) in a uint8 cache. The index cache is of the
    # qkv dtype, or float8_e4m3fn where the fork allows an fp8 index cache.
    main_dtype = qkv.dtype if kv_cache_dtype == "auto" else torch.uint8
    if kv_cache.dtype != main_dtype:
        raise RuntimeError(BF16_ONLY if kv_cache_dtype == "auto" else f"{kv_cache_dtype} needs a uint8 kv_cache")
    if index_cache is not None and index_cache.dtype not in (qkv.dtype, torch.float8_e4m3fn):
        raise RuntimeError(f"index cache dtype must be {qkv.dtype} or Float8_e4m3fn, got {index_cache.dtype}")
    assert slot_mapping is not None
    if kv_cache.shape[2] != block_size:
        raise RuntimeError(f"block_size {block_size} does not match the cache ({kv_cache.shape[2]})")
    for half, rows in ((0, k), (1, qkv[:, k_end:v_end])):
        _scatter_into(kv_cache[:, half], slot_mapping, rows if kv_cache_dtype == "auto" else to_e4m3_bits(rows))
    if index_cache is not None and index_k is not None:
        slots = index_slot_mapping if index_slot_mapping is not None else slot_mapping
        if index_cache.dtype == torch.float8_e4m3fn:  # clamp to +-448, convert: e4m3 of x / 1
            _scatter_rows(_bytes(index_cache).view(-1, index_k.shape[-1]), slots, to_e4m3_bits(index_k))
        else:
            _scatter_rows(index_cache.view(-1, index_k.shape[-1]), slots, index_k)


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    if slot_mapping.dtype != torch.int64:  # the kernel reads it through data_ptr<int64_t>()
        raise RuntimeError(f"reshape_and_cache_flash: slot_mapping must be int64, got {slot_mapping.dtype}")
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if kv_cache_dtype == "auto":
            if cache.dtype != x.dtype:
                raise RuntimeError(
                    f"reshape_and_cache_flash: 'auto' needs a {x.dtype} cache, got {cache.dtype}"
                )
            rows = x
        elif kv_cache_dtype in FP8_DTYPES:
            if cache.dtype not in FP8_CACHE_DTYPES:
                raise RuntimeError(
                    f"reshape_and_cache_flash: fp8 needs a 1-byte (uint8 or float8_e4m3fn) cache, got {cache.dtype}"
                )
            rows, cache = to_e4m3_bits(x, scale), _bytes(cache)
        else:
            raise NotImplementedError(f"reference op: kv_cache_dtype={kv_cache_dtype!r}")
        _scatter_into(cache, slot_mapping, rows)
