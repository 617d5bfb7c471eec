"""vLLM's own pieces as the stand-in runs them (:mod:`rewriter.verify.standin`), by the names vLLM
gives them: a file may import one under another name. Each answers as vLLM's does for what the
stand-in runs (the "auto" and fp8 cache dtypes, this run's tensor-parallel rank); anything else is a
:class:`StandInGap`, never a guess."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, NamedTuple


class StandInGap(Exception):
    """What the file needs here is something the stand-in does not model: not the file's fault."""


def _divide(numerator: int, denominator: int) -> int:
    """vLLM's ``divide`` (vllm.distributed.utils): exact division, asserted."""
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


def linear_width(name: str, args: tuple, kwargs: dict, tp: int = 1) -> int | None:
    """The output width vLLM's linear layers give one rank of ``tp``, from their arguments
    (``disable_tp=True``: the whole width): a QKV layer this rank's q heads and its KV heads
    (one where ``tp`` exceeds them, replicated), a column-parallel one its ``1/tp`` of the
    columns, a row-parallel or replicated one all of them."""

    def arg(i: int, key: str, default: Any = None) -> Any:
        return args[i] if len(args) > i else kwargs.get(key, default)

    tp = 1 if kwargs.get("disable_tp") else tp
    try:
        if name == "QKVParallelLinear":
            head, heads = int(arg(1, "head_size")), int(arg(2, "total_num_heads"))
            kv = int(arg(3, "total_num_kv_heads") or heads)
            heads, kv = _divide(heads, tp), (1 if tp >= kv else _divide(kv, tp))
            return (heads + kv) * head + kv * int(kwargs.get("v_head_size") or head)
        if name in ("ReplicatedLinear", "RowParallelLinear"):
            return int(arg(1, "output_size"))
        if name == "ColumnParallelLinear":
            return _divide(int(arg(1, "output_size")), tp)
        if name == "MergedColumnParallelLinear":
            return sum(_divide(int(x), tp) for x in arg(1, "output_sizes"))
    except (TypeError, ValueError, AssertionError):
        return None
    return None


class KVQuantMode(enum.IntEnum):
    """vLLM's KV-cache quantization modes (``vllm.v1.kv_cache_interface``), each a test that reads false
    but for its own mode; the stand-in's runs are ``NONE`` ("auto") or ``FP8_PER_TENSOR`` (any fp8)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT = 6

    @property
    def is_per_token_head(self) -> bool:
        return self.name.endswith("_PER_TOKEN_HEAD")

    @property
    def is_nvfp4(self) -> bool:
        return self is KVQuantMode.NVFP4

    @property
    def is_turboquant(self) -> bool:
        return self is KVQuantMode.TURBOQUANT


def get_kv_quant_mode(kv_cache_dtype: Any) -> KVQuantMode:
    """vLLM's ``get_kv_quant_mode`` for the dtypes the stand-in runs; another one is not modelled."""
    if kv_cache_dtype == "auto":
        return KVQuantMode.NONE
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        return KVQuantMode.FP8_PER_TENSOR
    raise StandInGap(f"the kv-cache dtype {kv_cache_dtype!r} is not modelled by the stand-in")


def _is_quantized_kv_cache(kv_cache_dtype: Any) -> bool:
    """vLLM's ``is_quantized_kv_cache``: the dtype has a quantization mode (older versions:
    ``kv_cache_dtype != "auto"``, which agrees on every dtype the stand-in runs)."""
    return get_kv_quant_mode(kv_cache_dtype) is not KVQuantMode.NONE


# What vLLM's tensor-parallel queries answer, by the name vLLM gives them: the run's rank.
TP = {
    "get_tensor_model_parallel_world_size": lambda parallel: parallel.size,
    "get_tensor_model_parallel_rank": lambda parallel: parallel.rank,
}


class DeviceCapability(NamedTuple):
    """vLLM's ``DeviceCapability``."""

    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor

    def as_version_str(self) -> str:
        return f"{self.major}.{self.minor}"


class Sm89Platform:
    """vLLM's ``current_platform`` as the card the tool is for answers it (an RTX 4090 class GPU: CUDA,
    compute capability 8.9), so a file's platform branches take the path they take there; any other
    query is a :class:`StandInGap`."""

    CAPABILITY = DeviceCapability(8, 9)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise StandInGap(f"`current_platform.{name}` is not modelled by the stand-in")

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability:
        return self.CAPABILITY

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        return _capability(self.CAPABILITY) >= _capability(capability)

    def is_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        return _capability(self.CAPABILITY) == _capability(capability)

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return _capability(self.CAPABILITY) // 10 == capability // 10


def _capability(capability: tuple[int, int] | int) -> int:
    """89 for (8, 9) and for 89, as vLLM compares them."""
    return DeviceCapability(*capability).to_int() if isinstance(capability, tuple) else capability



# vLLM helpers the stand-in runs as vLLM defines them, by the name vLLM gives them (a file may
# import one under another name); any other imported name is a made-up `_Imported`.
VLLM_HELPERS: dict[str, Callable[..., Any]] = {
    "is_quantized_kv_cache": _is_quantized_kv_cache,
    "divide": _divide,
    "get_kv_quant_mode": get_kv_quant_mode,
    "KVQuantMode": KVQuantMode,  # (a class: what the file compares a mode with)
    "current_platform": Sm89Platform(),  # type: ignore[dict-item]
}


