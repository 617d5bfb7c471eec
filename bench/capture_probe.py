"""What the write a bypass keeps may do under a captured CUDA graph, and what vLLM's kernel reads.

``codemods.guards.host_syncs`` refuses a value read from the device and handed to the host (tested,
converted, formatted, a slice bound, ``repeat_interleave``'s repeats), and lets what the host knows of a
tensor (its shape, ``numel()``, ``len``) through. Each spelling here is captured with
``torch.cuda.graph`` in a process of its own: ``"captured"`` or the error capture raised. With
``--kernels`` (vLLM's ``_C`` library) it also hands ``reshape_and_cache_flash`` int32 slot mappings (the
kernel reads ``data_ptr<int64_t>()``) and writes one key with ``"fp8"`` and with ``"fp8_e5m2"`` (the
kernel quantizes by the string it is handed, not by the cache).

  python bench/capture_probe.py [--kernels PATH/TO/_C.so]   # on a CUDA machine

Prints one JSON object; exit 1 when a spelling's outcome is not the one the rule expects.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

# name -> (code run under capture, with key, slots and scale on the device; the rule's verdict: a sync)
CASES = {
    "a tensor element tested in a loop": ("[0 for s in slots if s >= 0]", True),
    "a mask through an alias": ("valid = slots >= 0; keep = valid; key[keep]", True),
    "a mask made by .to(torch.bool)": ("key[(slots + 1).to(torch.bool)]", True),
    "a mask made by torch.greater_equal": ("key[torch.greater_equal(slots, 0)]", True),
    "a count held in a local, then tested": ("n = (slots >= 0).sum()\nif n: pass", True),
    "the scale converted to a float": ("float(scale)", True),
    "a count converted to an int": ("int(torch.count_nonzero(slots >= 0))", True),
    "a count as a slice's bound": ("key[: (slots >= 0).sum()]", True),
    "slots formatted into a string": ('f"{slots}"', True),
    "repeat_interleave by a tensor": ("torch.repeat_interleave(torch.arange(key.shape[0], device=key.device), (slots >= 0).long())", True),
    "the shape formatted into a string": ('f"{key.shape} {key.dtype}"', False),
    "a slice bound by the shape": ("key[: key.shape[0]] * 2", False),
    "numel and len converted to an int": ("int(key.numel()) + len(key)", False),
    "repeat_interleave by an int": ("key.repeat_interleave(2, dim=0)", False),
    "the index write's scatter by slots": ("flat = torch.zeros(64, 8, device=key.device); flat[slots.clamp(min=0)] = key", False),
}

CHILD = """
import sys, torch
code = sys.argv[1]
torch.manual_seed(0)
key = torch.randn(16, 8, device="cuda")
slots = torch.randperm(63, device="cuda")[:16]
slots[-3:] = -1
scale = torch.ones((), dtype=torch.float32, device="cuda")
env = {"torch": torch, "key": key, "slots": slots, "scale": scale}
exec(code, dict(env))  # warm up outside capture
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        exec(code, dict(env))
except Exception as exc:
    print(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
else:
    print("captured")
"""


def capture() -> dict:
    out = {}
    for name, (code, sync) in CASES.items():
        proc = subprocess.run([sys.executable, "-c", CHILD, code], capture_output=True, text=True, timeout=120)
        said = (proc.stdout.strip().splitlines() or [proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"])[-1]
        out[name] = {"rule: sync": sync, "capture": said, "agrees": (said != "captured") is sync}
    return out


def kernel(kernels: str) -> dict:
    import torch

    torch.ops.load_library(kernels)
    reshape = torch.ops._C_cache_ops.reshape_and_cache_flash
    torch.manual_seed(0)
    tokens, heads, d, blocks, bs = 8, 2, 64, 4, 16
    key = torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(blocks * bs, device="cuda")[:tokens]
    one = torch.ones((), dtype=torch.float32, device="cuda")
    out: dict = {}
    try:
        cache = torch.zeros(blocks, bs, heads, d, dtype=torch.uint8, device="cuda")
        reshape(key, key, cache, cache.clone(), slots.to(torch.int32), "fp8", one, one)
        torch.cuda.synchronize()
        out["int32 slots"] = "accepted"
    except Exception as exc:
        out["int32 slots"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    written = {}
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        cache = torch.zeros(blocks, bs, heads, d, dtype=torch.uint8, device="cuda")
        reshape(key, key, cache, cache.clone(), slots, dtype, one, one)
        written[dtype] = cache.view(-1, heads, d)[slots].cpu()
    out["fp8 and fp8_e4m3 write the same bytes"] = bool(torch.equal(written["fp8"], written["fp8_e4m3"]))
    out["fp8 and fp8_e5m2 write the same bytes"] = bool(torch.equal(written["fp8"], written["fp8_e5m2"]))
    back = written["fp8"].view(torch.float8_e5m2).float()
    ref = written["fp8_e5m2"].view(torch.float8_e5m2).float()
    out["e4m3 bytes read as e5m2: largest error"] = float((back - ref).abs().max())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", help="vLLM's _C library (reshape_and_cache_flash)")
    args = parser.parse_args()
    result = {"capture": capture()}
    if args.kernels:
        result["kernel"] = kernel(args.kernels)
    print(json.dumps(result, indent=1))
    agrees = all(r["agrees"] for r in result["capture"].values())
    kernel_ok = not args.kernels or (
        result["kernel"]["int32 slots"] != "accepted" and result["kernel"]["fp8 and fp8_e4m3 write the same bytes"]
        and not result["kernel"]["fp8 and fp8_e5m2 write the same bytes"]
    )
    return 0 if agrees and kernel_ok else 1


if __name__ == "__main__":
    sys.exit(main())
