"""Stop 54: vLLM 0.34.0's native layer, which ``check`` promised without running. The stand-in now runs what it
needs: a platform branch answered as the card the tool is for (SM89: CUDA, capability 8.9), a vLLM import made
inside a function, the index cache's query dtype, and the op's ``write_qkv``. What it still does not model stays
a gap, named."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_hunt47 import NATIVE, _edited

torch = pytest.importorskip("torch")

from rewriter.verify import Status, refops  # noqa: E402
from rewriter.verify.vllm_parts import Sm89Platform  # noqa: E402

IMPORTS = "from vllm.forward_context import get_forward_context\n"
INIT_END = "        self.kv_cache = torch.tensor([])\n"
CALL_END = "            self.kv_cache_dtype,\n        )\n        return self.attend(q, index_q)\n"
INDEX_Q = "        index_q = qkv.new_empty((num_tokens, self.index_q_size))\n"
HELPER = '''

def _supports_epilogue(attn) -> bool:
    from vllm.model_executor.kernels.linear import BlackwellKernel

    if not current_platform.is_device_capability_family(100):
        return False
    return isinstance(getattr(attn.qkv_proj.quant_method, "kernel", None), BlackwellKernel)
'''
# 0.34.0's shape: a Blackwell-only epilogue decided in __init__ (the stand-in's projection has no quant_method:
# the SM89 answer must return before it is read), index_q of the index cache's query dtype, and `write_qkv`.
V034 = [
    (IMPORTS, IMPORTS + "from vllm.platforms import current_platform\n" + HELPER),
    (INIT_END, INIT_END + "        self.use_epilogue = _supports_epilogue(self)\n"),
    (INDEX_Q, "        assert not self.use_epilogue\n"
     "        index_q = torch.empty((num_tokens, self.index_q_size), dtype=self.indexer.index_cache.query_dtype)\n"),
    (CALL_END, "            self.kv_cache_dtype,\n            write_qkv=True,\n        )\n        return self.attend(q, index_q)\n"),
]


def semantic(path: Path):
    from test_fp8_index import semantic

    return semantic(path)


def test_vllm_034s_layer_is_run(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, V034))
    level = semantic(path)
    assert level.status is Status.PASSED, level.reason


def test_a_platform_branch_takes_sm89s_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A branch for capability 9.0 and up is not taken; answered as an H100 (the device machine), it is."""
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [
        (IMPORTS, IMPORTS + "from vllm.platforms import current_platform\n"),
        (INDEX_Q, INDEX_Q + "        if current_platform.has_device_capability(90) or not current_platform.is_cuda():\n"
         "            q = q.view(-1, 7, 5)\n"),
    ]))
    assert semantic(path).status is Status.PASSED
    monkeypatch.setattr(Sm89Platform, "CAPABILITY", (9, 0))
    assert semantic(path).status is Status.FAILED


def test_an_unmodelled_platform_query_is_a_gap(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [
        (IMPORTS, IMPORTS + "from vllm.platforms import current_platform\n"),
        (INDEX_Q, INDEX_Q + "        q = q.to(current_platform.fp8_dtype())\n"),
    ]))
    level = semantic(path)
    assert level.status is Status.SKIPPED and "`current_platform.fp8_dtype` is not modelled" in level.reason, level.reason


@pytest.mark.parametrize("module", ["aiter_not_here", "vllm.models.minimax_m3.amd.ops.sparse_pa"])
def test_a_module_forward_imports_that_is_not_here_stays_a_gap(tmp_path: Path, module: str) -> None:
    """Only ``__init__``'s imports of vLLM's own modules are made up where they are missing: what ``forward``
    imports is a platform's path (the AMD file's AITER ops, whose cache layout the stand-in does not build), and
    running on past it failed a file that works."""
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [
        (INDEX_Q, INDEX_Q + f"        from {module} import rope\n        if rope is not None:\n            raise RuntimeError\n"),
    ]))
    level = semantic(path)
    assert level.status is Status.SKIPPED and f"imports `{module.split('.')[0]}`" in level.reason, level.reason


def test_write_qkv_false_leaves_qkv_and_writes_the_same_cache() -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, tokens, blocks, block = 2, 1, 8, 3, 2, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    args = (torch.zeros(dim, dtype=torch.bfloat16), torch.zeros(dim, dtype=torch.bfloat16),
            torch.randn(16, 4, generator=g).to(torch.bfloat16), torch.arange(tokens), heads, kv_heads, 4, 1e-6)
    caches = []
    for write in (True, False):
        buffer, cache = qkv.clone(), torch.zeros(blocks, 2, block, kv_heads, dim, dtype=torch.bfloat16)
        q_out = torch.empty(tokens, heads * dim, dtype=torch.bfloat16)
        refops.fused_minimax_m3_qknorm_rope_kv_insert(
            buffer, *args, slot_mapping=torch.tensor([0, -1, 5]), kv_cache=cache, block_size=block, q_out=q_out,
            write_qkv=write,
        )
        assert torch.equal(buffer, qkv) is not write  # (k is rewritten in place only where asked)
        caches.append(cache)
    assert torch.equal(*caches) and caches[0].abs().sum() > 0


def test_a_norm_called_as_a_module_is_a_gap(tmp_path: Path) -> None:
    """The stand-in's norms are their weights; a file that runs one as a module (the AMD file's
    ``self.q_norm(q)``) was failed for it ("object is not callable"), though vLLM's norm is callable."""
    path = tmp_path / "model.py"
    path.write_text(_edited(NATIVE, [(INDEX_Q, INDEX_Q + "        q = self.q_norm(q)\n")]))
    level = semantic(path)
    assert level.status is Status.SKIPPED and "calls a module of the layer" in level.reason, level.reason
