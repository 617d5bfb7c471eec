"""The index write `run` generates, on vLLM's real reshape_and_cache_flash (CUDA).

The generated ``_insert_kv`` writes the index key with ``reshape_and_cache_flash``,
key and value both the index key viewed ``[N, 1, D]``, the index cache viewed
``[slots, 1, 1, D]``, and the store picked by the index cache's dtype: ``"auto"``
for a bf16 cache, ``"fp8_e4m3"`` with an identity scale for a ``float8_e4m3fn`` one
(vLLM's ``indexer_kv_dtype`` "fp8"). This checks, with the real op, what that
relies on: each written row is the key (bf16) or ``clamp(key, ±448)`` converted to
e4m3 (fp8: saturating, as the fused op stores an fp8 index key), padded tokens
(slot -1) write nothing, and no other row changes.

  python bench/fp8_index_probe.py --kernels PATH/TO/_C.so   # or with vLLM installed

Prints one JSON object; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys


def probe(kernels: str | None, tokens: int = 257, padded: int = 3, seed: int = 0) -> dict:
    import torch

    if kernels:
        torch.ops.load_library(kernels)
        reshape = torch.ops._C_cache_ops.reshape_and_cache_flash
    else:
        from vllm import _custom_ops as ops

        reshape = ops.reshape_and_cache_flash
    torch.manual_seed(seed)
    dev, d, rows = "cuda", 128, 1024
    key = (torch.randn(tokens, d, device=dev) * 200).to(torch.bfloat16)  # some past ±448
    slots = torch.randperm(rows, device=dev)[:tokens].clone()
    slots[-padded:] = -1
    one = torch.ones((), dtype=torch.float32, device=dev)
    out: dict = {"tokens": tokens, "padded": padded, "head_dim": d}
    for name, dtype, store in (("bf16", torch.bfloat16, "auto"), ("fp8_e4m3", torch.float8_e4m3fn, "fp8_e4m3")):
        cache = torch.zeros(rows, d, device=dev).to(dtype)
        before = cache.view(torch.uint8).clone() if dtype.itemsize == 1 else cache.clone()
        idx_key = key.view(-1, 1, d)
        idx_cache = cache.view(-1, 1, 1, d)
        reshape(idx_key, idx_key, idx_cache, idx_cache, slots, store, one, one)
        torch.cuda.synchronize()
        real = slots[:-padded].long()
        want = key[:-padded] if dtype == torch.bfloat16 else key[:-padded].float().clamp(-448, 448).to(dtype)
        as_bytes = (lambda t: t.view(torch.uint8)) if dtype.itemsize == 1 else (lambda t: t)
        written = bool(torch.equal(as_bytes(cache)[real], as_bytes(want)))
        untouched = torch.ones(rows, dtype=torch.bool, device=dev)
        untouched[real] = False
        others = bool(torch.equal(as_bytes(cache)[untouched], before[untouched]))
        out[name] = {"rows written exactly": written, "padded and other rows untouched": others}
    out["passed"] = all(v for k in ("bf16", "fp8_e4m3") for v in out[k].values())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="vLLM's kernel library (else the installed vLLM's ops)")
    result = probe(parser.parse_args().kernels)
    print(json.dumps(result, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
