"""Stop 51: what real fork versions no earlier stop had seen need of ``verify``'s stand-in (newer vLLM's fused-op
arguments, its KV quantization modes, its attention impl's questions), and one fork's ``__init__`` that reads a name
the file never binds: ``check`` refuses it and the semantic level fails it, where the stand-in had called it a gap."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hunt47 import NATIVE, _edited, _states

torch = pytest.importorskip("torch")

from rewriter.verify import (
    Status,
    refops,
)
from rewriter.verify.vllm_parts import KVQuantMode, StandInGap, get_kv_quant_mode

CALL_END = "            self.kv_cache_dtype,\n        )\n        return self.attend(q, index_q)\n"
DTYPE = "        self.kv_cache_dtype = cache_config.cache_dtype\n"
IMPORTS = "from vllm.forward_context import get_forward_context\n"

# vLLM's newer native layer: an fp8 query buffer where the attention impl decodes with one, handed to the op with
# its scale; the NVFP4 cache's scales where the cache is NVFP4 (vllm.v1.kv_cache_interface's quantization mode).
NEWER = [
    (IMPORTS, IMPORTS + "from vllm.v1.kv_cache_interface import KVQuantMode, get_kv_quant_mode\n"),
    (DTYPE, DTYPE + "        self.use_nvfp4_kv = get_kv_quant_mode(self.kv_cache_dtype) == KVQuantMode.NVFP4\n"),
    ("        index_q = qkv.new_empty((num_tokens, self.index_q_size))\n",
     ("        index_q = qkv.new_empty((num_tokens, self.index_q_size))\n"
     "        use_fp8_query = self.impl.should_use_msa_decode(self.layer_name) or getattr(self.impl, 'use_cutlass_decode', False)\n"
     "        query_fp8 = torch.empty((num_tokens, self.q_size), dtype=torch.float8_e4m3fn) if use_fp8_query else None\n")),
    (CALL_END,
     ("            self.kv_cache_dtype,\n            q_fp8_out=query_fp8,\n            q_fp8_scale=self._q_scale_float,\n"
     "            kv_k_scale=self._k_scale if self.use_nvfp4_kv else None,\n"
     "            kv_v_scale=self._v_scale if self.use_nvfp4_kv else None,\n"
     "        )\n        return self.attend(q, index_q)\n")),
]


def semantic(path: Path):
    from test_fp8_index import semantic

    return semantic(path)


def test_a_newer_native_layer_is_verified(tmp_path: Path) -> None:
    """The stand-in ran none of these: the op refused the new arguments, the quantization mode was a made-up value."""
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, NEWER))
    assert _states(path)[-1] == "native"
    level = semantic(path)
    assert level.status is Status.PASSED, level.reason


def test_the_stand_in_models_the_quantization_modes_of_the_dtypes_it_runs() -> None:
    assert get_kv_quant_mode("auto") is KVQuantMode.NONE
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        mode = get_kv_quant_mode(dtype)
        assert mode is KVQuantMode.FP8_PER_TENSOR and not (mode.is_nvfp4 or mode.is_per_token_head)
    with pytest.raises(StandInGap):  # a dtype the stand-in never runs is not guessed at
        get_kv_quant_mode("nvfp4")
    assert KVQuantMode.INT8_PER_TOKEN_HEAD.is_per_token_head and KVQuantMode.NVFP4.is_nvfp4


def test_the_reference_op_writes_the_fp8_query_it_is_handed() -> None:
    """q as saturating e4m3 of ``q / q_fp8_scale``, beside the bf16 q; an NVFP4 cache's scales are not modelled."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens = 2, 1, 8, 3
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 300).to(torch.bfloat16)
    args = (torch.zeros(dim, dtype=torch.bfloat16), torch.zeros(dim, dtype=torch.bfloat16),
            torch.zeros(16, 4, dtype=torch.bfloat16), torch.zeros(tokens, dtype=torch.long), heads, kv_heads, 4, 1e-6)
    q_out = torch.empty(tokens, heads * dim, dtype=torch.bfloat16)
    q_fp8 = torch.empty(tokens, heads * dim, dtype=torch.float8_e4m3fn)
    refops.fused_minimax_m3_qknorm_rope_kv_insert(qkv, *args, q_out=q_out, q_fp8_out=q_fp8, q_fp8_scale=2.0)
    assert torch.equal(q_fp8.view(torch.uint8), refops.to_e4m3_bits(q_out, 2.0))
    with pytest.raises(NotImplementedError, match="NVFP4"):
        refops.fused_minimax_m3_qknorm_rope_kv_insert(qkv, *args, kv_k_scale=torch.ones(()))


RANK = "        self.tp_rank = get_tensor_model_parallel_rank()\n"
# phoenixclyde's gfx906 fork: __init__ reads a name the file never imports. vLLM raises NameError building the layer.
UNBOUND = [(DTYPE, DTYPE + RANK)]


def test_a_name_init_reads_and_the_file_never_binds_is_refused_and_fails(tmp_path: Path) -> None:
    from conftest import cli

    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [*UNBOUND, (IMPORTS, IMPORTS + "from vllm.distributed import get_tensor_model_parallel_rank\n")]))
    assert _states(path)[-1] == "native"  # the control: imported
    path.write_text(_edited(NATIVE, UNBOUND))
    proc = cli("check", str(path))
    assert proc.returncode == 2 and "reads `get_tensor_model_parallel_rank`, which neither the function nor the module binds" in proc.stdout + proc.stderr
    level = semantic(path)  # (the stand-in had skipped the statement and called the missing attribute its gap)
    assert level.status is Status.FAILED and "NameError" in level.reason and "in __init__" in level.reason


@pytest.mark.parametrize(
    "bound",
    [
        "try:\n    from vllm.distributed import get_tensor_model_parallel_rank\nexcept ImportError:\n    pass\n",
        "from vllm.distributed import *\n",  # a star import may bind it
        "def get_tensor_model_parallel_rank():\n    return 0\n",
    ],
)
def test_a_name_the_file_binds_anyhow_is_not_refused(tmp_path: Path, bound: str) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [*UNBOUND, (IMPORTS, IMPORTS + bound)]))
    assert _states(path)[-1] == "native"
