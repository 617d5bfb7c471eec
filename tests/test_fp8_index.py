"""An fp8 index cache (`--attention-config '{"indexer_kv_dtype": "fp8"}'`) at the semantic level.

vLLM allocates the index cache as a real float8_e4m3fn tensor; the fused op (of the forks that
allow one) stores index_k clamped to +-448 and converted, the bypass writes it with
`reshape_and_cache_flash(..., "fp8_e4m3", scale 1)`. A layer whose code reads the indexer dtype
is run once more, on each path it has, with such a cache: both runs must store the same e4m3
bits - those of the bf16 index cache converted - and no padded token (slot -1) may write.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES

from rewriter.targets import Target

torch = pytest.importorskip("torch")

from rewriter.verify import Status, layercode, refops, standin, verify  # noqa: E402
from rewriter.verify.semantic import check_layer, reads_indexer_dtype  # noqa: E402

LAYER = "MiniMaxM3SparseAttention"
FP8_WRITE = '            idx_dtype = "fp8_e4m3"  # an fp8 index cache: x / 1, saturating\n'
PADDED = "padded tokens (slot -1, last 3) wrote nothing"


def semantic(path: Path):
    (entry,) = verify([Target(path, "test")], timing=False).files
    return next(level for level in entry.levels if level.level == "semantic")


def edited(tmp_path: Path, old: str, new: str, variant: str = "fp8_index") -> Path:
    source = (FIXTURES / variant / "expected.py").read_text()
    assert source.count(old) == 1
    path = tmp_path / "model.py"
    path.write_text(source.replace(old, new))
    return path


def test_the_fixture_passes_with_an_fp8_index_cache_on_both_paths() -> None:
    level = semantic(FIXTURES / "fp8_index" / "expected.py")
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)
    assert "eager and compiled paths" in level.reason
    for path in ("", "compiled: "):
        for check in (
            "index cache identical",
            "index cache = e4m3(bf16 index cache) at every written slot",
            PADDED,
        ):
            assert f"{LAYER}: fp8 index cache: {path}{check}: yes" in level.details
    assert f"{LAYER}: fp8 index cache: compiled: caches = eager's (bf16): yes" in level.details


def test_the_fp8_index_runs_hold_a_float8_index_cache_and_the_file_reads_fp8() -> None:
    code = layercode.load_layer(FIXTURES / "fp8_index" / "expected.py", LAYER)
    assert code.compile_aware and reads_indexer_dtype(code)
    inputs = standin.Inputs.random(code.fit(layercode.DISTINCT))
    result, runs = check_layer(code, standin.REFERENCE, inputs)
    assert result.passed, result.reason
    modes = {run.mode: run.index_cache.dtype for run in runs}
    assert modes == {
        "bf16": torch.bfloat16,
        "fp8": torch.bfloat16,
        "bf16 compiled": torch.bfloat16,
        "fp8 compiled": torch.bfloat16,
        "bf16 fp8-index": torch.float8_e4m3fn,
        "fp8 fp8-index": torch.float8_e4m3fn,
        "bf16 fp8-index compiled": torch.float8_e4m3fn,
        "fp8 fp8-index compiled": torch.float8_e4m3fn,
    }
    # __init__ read the run's indexer dtype off the attention config.
    for mode, expect in (("bf16", "auto"), ("fp8 fp8-index compiled", "fp8")):
        layer, _, _ = standin._standin(code, standin.REFERENCE, inputs, mode)
        assert layer.indexer_kv_dtype == expect


def test_a_layer_that_never_names_the_indexer_dtype_gets_no_fp8_index_runs() -> None:
    level = semantic(FIXTURES / "compiled_native" / "expected.py")
    assert level.status is Status.PASSED, level.reason
    assert not any("fp8 index cache:" in d for d in level.details)


def test_the_old_scatter_on_the_fp8_index_cache_fails_the_fp8_index_check(tmp_path: Path) -> None:
    """The fork's old write, `idx_cache[slots] = index_key.to(idx_cache.dtype)`, kept for an fp8
    index cache only: the bf16 runs cannot see it; the fp8 index runs see the padded tokens."""
    path = edited(
        tmp_path,
        FP8_WRITE,
        "            idx_cache.view(-1, self.idx_head_dim)[index_slot_mapping] = index_key.to(idx_cache.dtype)\n"
        "            return\n",
    )
    level = semantic(path)
    assert level.status is Status.FAILED
    assert f"fp8 index cache: {PADDED}" in level.reason
    assert f"{LAYER}: {PADDED}: yes" in level.details  # the bf16 index cache is written right
    assert f"{LAYER}: fp8 index cache: {PADDED}: NO" in level.details
    # The whole file's old scatter (model.py) fails already with a bf16 index cache.
    before = semantic(FIXTURES / "fp8_index" / "model.py")
    assert before.status is Status.FAILED and f"{PADDED}: no" in before.reason


def test_the_index_key_stored_unquantized_into_the_fp8_cache_fails(tmp_path: Path) -> None:
    """"auto" copies the bf16 key: the real kernel would write two bytes per element into a
    one-byte cache; the reference refuses, and the run fails."""
    level = semantic(edited(tmp_path, FP8_WRITE, '            idx_dtype = "auto"\n'))
    assert level.status is Status.FAILED
    assert level.reason.startswith(f"{LAYER}: fp8 index cache: ")
    assert "'auto' needs a torch.bfloat16 cache, got torch.float8_e4m3fn" in level.reason


def test_an_fp8_index_store_at_another_scale_fails(tmp_path: Path) -> None:
    """x / 2 into the fp8 index cache: quantized, but not what the fused op stores (x / 1)."""
    path = edited(
        tmp_path,
        "            index_slot_mapping,\n            idx_dtype,\n            scale,\n            scale,\n",
        "            index_slot_mapping,\n            idx_dtype,\n            2 * scale,\n            2 * scale,\n",
    )
    level = semantic(path)
    assert level.status is Status.FAILED
    assert f"{LAYER}: index cache identical: yes" in level.details  # a bf16 index cache is copied
    for check in ("index cache identical", "index cache = e4m3(bf16 index cache) at every written slot"):
        assert f"fp8 index cache: {check}" in level.reason


# --- the reference ops ----------------------------------------------------------------------


def _fused(inputs: standin.Inputs, index_cache: torch.Tensor, k_norm_scale: float) -> None:
    s = inputs.shape
    kv = torch.zeros(s.num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=torch.bfloat16)
    w = inputs.weights
    refops.fused_minimax_m3_qknorm_rope_kv_insert(
        inputs.qkv.clone(), w["q_norm"], w["k_norm"], inputs.cos_sin_cache, inputs.positions,
        s.num_heads, s.num_kv_heads, s.rotary_dim, s.eps,
        w["index_q_norm"], w["index_k_norm"] * k_norm_scale, s.num_idx_heads,
        inputs.main_slots, inputs.index_slots, kv, index_cache, s.block_size,
    )  # fmt: skip


def test_the_fused_reference_stores_index_k_in_fp8_as_a_saturating_cast_of_the_clamped_key() -> None:
    """Norm weights of ~1000 push index_k past e4m3's 448: the store must be torch's cast of
    clamp(x, -448, 448), bit for bit, and slot -1 writes nothing."""
    inputs = standin.Inputs.random(layercode.DISTINCT)
    s = inputs.shape
    bf16 = torch.zeros(s.num_blocks, s.block_size, s.idx_head_dim, dtype=torch.bfloat16)
    fp8 = torch.zeros(s.num_blocks, s.block_size, s.idx_head_dim, dtype=torch.float8_e4m3fn)
    _fused(inputs, bf16, 1000.0)
    _fused(inputs, fp8, 1000.0)
    rows = s.num_blocks * s.block_size
    written = inputs.index_slots[inputs.valid_index].long()
    x = bf16.reshape(rows, -1)[written].float()
    assert (x.abs() > refops.E4M3_MAX).any() and (x.abs() < refops.E4M3_MAX).any()
    expect = torch.clamp(x, -refops.E4M3_MAX, refops.E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    stored = fp8.view(torch.uint8).reshape(rows, -1)
    assert torch.equal(stored[written], expect)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[written] = False
    assert bool((stored[untouched] == 0).all())


def test_reshape_and_cache_flash_stores_e4m3_bits_into_a_float8_cache_as_into_a_uint8_one() -> None:
    g = torch.Generator().manual_seed(3)
    key = (torch.randn(10, 1, 16, generator=g) * 300).to(torch.bfloat16)
    slots = torch.tensor([4, 0, 9, 2, 7, 11, 5, 1, -1, -1])
    scale = torch.ones(())
    caches = {dt: torch.zeros(12, 1, 1, 16, dtype=dt) for dt in (torch.uint8, torch.float8_e4m3fn)}
    for cache in caches.values():
        refops.reshape_and_cache_flash(key, key, cache, cache, slots, "fp8_e4m3", scale, scale)
    as_bytes = caches[torch.float8_e4m3fn].view(torch.uint8)
    assert torch.equal(as_bytes, caches[torch.uint8])
    x = key[:8].float().reshape(8, -1)
    expect = torch.clamp(x, -refops.E4M3_MAX, refops.E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(as_bytes.reshape(12, -1)[slots[:8]], expect)
    assert bool((as_bytes.reshape(12, -1)[[3, 6, 8, 10]] == 0).all())  # slot -1 wrote nothing
    # What the real op would garble is refused: a copy into a cache of another dtype.
    with pytest.raises(RuntimeError, match="'auto' needs a torch.bfloat16 cache"):
        refops.reshape_and_cache_flash(key, key, caches[torch.float8_e4m3fn], caches[torch.float8_e4m3fn],
                                       slots, "auto", scale, scale)  # fmt: skip
    bf16 = torch.zeros(12, 1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp8 needs a 1-byte"):
        refops.reshape_and_cache_flash(key, key, bf16, bf16, slots, "fp8", scale, scale)


# --- vLLM's is_quantized_kv_cache, modelled -----------------------------------------------------


def test_a_flag_set_with_vllms_is_quantized_kv_cache_runs_for_real(tmp_path: Path) -> None:
    """The helper is `kv_cache_dtype != "auto"` in the stand-in, not a made-up value: the bf16
    run takes the fused insert, the fp8 run the bypass, and the level passes."""
    source = (FIXTURES / "fork_era" / "expected.py").read_text()
    flag = 'self._fp8_kv = "fp8" in self.kv_cache_dtype'
    assert source.count(flag) == 1 and source.count("\nimport torch\n") == 1
    source = source.replace(flag, "self._fp8_kv = quantized(self.kv_cache_dtype)").replace(
        "\nimport torch\n", "\nimport torch\nfrom vllm.v1.kv_cache_interface import is_quantized_kv_cache as quantized\n"
    )
    path = tmp_path / "model.py"
    path.write_text(source)
    level = semantic(path)
    assert level.status is Status.PASSED, level.reason + "\n" + "\n".join(level.details)
    assert f"{LAYER}: fp8 cache = e4m3(bf16 cache) at every written slot: yes" in level.details
    code = layercode.load_layer(path, LAYER)
    inputs = standin.Inputs.random(code.fit(layercode.DISTINCT))
    for mode, quantized in (("bf16", False), ("fp8", True)):
        layer, _, _ = standin._standin(code, standin.REFERENCE, inputs, mode)
        assert layer._fp8_kv is quantized
    assert standin.VLLM_HELPERS["is_quantized_kv_cache"]("fp8_e4m3") is True
    with pytest.raises(standin.StandInGap):  # a dtype the stand-in never runs is not guessed at
        standin.VLLM_HELPERS["is_quantized_kv_cache"]("nvfp4")
