"""`verify` at tensor-parallel shapes: the semantic level runs the file's own `__init__` and
methods as rank r of TP=N, each TP a row of the table, a failure naming the TP and the rank.

By default TP=1, one TP that shards the KV heads and one that replicates them, with
MiniMax-M3's head counts from the installed vLLM's config class (64 q / 4 KV / 4 index heads
in 0.24.0: TP 2 and 8), else the stand-in's in the same proportions (32 / 2 / 2: TP 2 and 4).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from conftest import FIXTURES, cli
from test_fixtures import VARIANTS

from rewriter.targets import Target

torch = pytest.importorskip("torch")

from rewriter.verify import Status, tp, verify  # noqa: E402
from rewriter.verify.layercode import DISTINCT  # noqa: E402
from rewriter.verify.vllm_parts import linear_width as _linear_width  # noqa: E402

CONFIG = "vllm/transformers_utils/configs/minimax_m3.py"
# What vLLM 0.24.0's MiniMaxM3TextConfig defaults to (its wheel, read in the test below).
REAL = tp.Heads(64, 4, 4, "MiniMax-M3's (vLLM 0.24.0's MiniMaxM3TextConfig)")
HEADS = {"real": REAL, "stand-in": tp.STAND_IN}


@pytest.fixture(params=sorted(HEADS))
def heads(request, monkeypatch) -> tp.Heads:
    """verify's model heads, whatever vLLM this interpreter has (or none)."""
    monkeypatch.setattr(tp, "model_heads", lambda: HEADS[request.param])
    return HEADS[request.param]


def semantic_rows(path: Path, **options) -> dict[str, object]:
    (result,) = verify([Target(path, "test")], **options).files
    return {lv.level: lv for lv in result.levels if lv.level.startswith("semantic")}


# --- which TPs, and each rank's sizes ---------------------------------------------------


def test_the_heads_are_read_from_the_installed_vllms_config_class(tmp_path: Path, monkeypatch) -> None:
    """An interpreter whose vLLM is 0.24.0 (its config file, on sys.path): its MiniMaxM3TextConfig's
    defaults, read and never imported (the package's __init__ raises)."""
    from test_real_wheels import vllm_wheel

    with zipfile.ZipFile(vllm_wheel("0.24.0")) as wheel:
        wheel.extract(CONFIG, tmp_path)
    (tmp_path / "vllm" / "__init__.py").write_text("raise RuntimeError('vllm was imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    heads = tp.model_heads.__wrapped__()
    assert (heads.q, heads.kv, heads.index) == (REAL.q, REAL.kv, REAL.index)
    assert "MiniMaxM3TextConfig" in heads.source
    (tmp_path / CONFIG).write_text("class MiniMaxM3TextConfig:\n    def __init__(self, num_attention_heads=64): ...\n")
    assert tp.model_heads.__wrapped__() == tp.STAND_IN  # no KV / index defaults: the stand-in's


def test_the_default_tps_shard_and_replicate_the_kv_heads() -> None:
    """The smallest TP that shards the KV heads, the smallest that replicates them (MiniMax-M3 at
    TP=8, the seed's); each its first and last rank. Every rank's sizes as vLLM computes them."""
    assert [(p.size, p.ranks) for p in tp.plans(heads=REAL)] == [(1, (0,)), (2, (0, 1)), (8, (0, 7))]
    assert [(p.size, p.ranks) for p in tp.plans(heads=tp.STAND_IN)] == [(1, (0,)), (2, (0, 1)), (4, (0, 3))]
    one, sharding, replicating = tp.plans(heads=REAL)
    assert one.shape(DISTINCT, 0) == DISTINCT
    assert sharding.role == "shards the 4 KV heads, 2 a rank"
    assert replicating.role == "replicates each of the 4 KV heads on 2 ranks"
    rank = replicating.shape(DISTINCT, 7)
    assert (rank.num_heads, rank.num_kv_heads, rank.num_idx_heads) == (8, 1, 1)
    assert (rank.head_dim, rank.idx_head_dim, rank.rotary_dim) == (64, 128, 32)  # DISTINCT's
    assert rank.totals == (64, 4, 4) and rank.parallel.rank == 7
    assert str(rank).startswith("rank 7 of TP=8: 8 q / 1 kv / 1 index heads")
    chosen = tp.plans([4], heads=REAL)
    assert [(p.size, p.ranks) for p in chosen] == [(1, (0,)), (4, (0, 1, 2, 3))]
    assert tp.plans([1], heads=REAL) == [tp.Plan(1)]


@pytest.mark.parametrize("size, why", [(3, "64 q heads do not divide over 3 ranks"), (12, "64 q heads")])
def test_a_tp_the_heads_do_not_shard_over_is_refused(size: int, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        tp.plans([size], heads=REAL)
    assert "KV heads" in (tp.unshardable(tp.Heads(48, 4, 4, ""), 6) or "")


def test_cli_tp_that_does_not_shard_is_exit_2_with_the_reason() -> None:
    proc = cli("verify", "--tp", "3", str(FIXTURES / "fork_era" / "expected.py"))
    assert proc.returncode == 2
    assert "--tp 3:" in proc.stderr and "do not divide over 3 ranks" in proc.stderr


def test_vllms_linear_layers_give_this_ranks_width() -> None:
    qkv = (256, 64, 64, 4)  # hidden, head size, q heads, KV heads
    assert _linear_width("QKVParallelLinear", qkv, {}) == (64 + 2 * 4) * 64
    assert _linear_width("QKVParallelLinear", qkv, {}, tp=2) == (32 + 2 * 2) * 64
    assert _linear_width("QKVParallelLinear", qkv, {}, tp=8) == (8 + 2 * 1) * 64  # a KV head replicated
    assert _linear_width("QKVParallelLinear", qkv, {"disable_tp": True}, tp=8) == (64 + 2 * 4) * 64
    assert _linear_width("ColumnParallelLinear", (256, 512), {}, tp=4) == 128
    assert _linear_width("MergedColumnParallelLinear", (256, [512, 256]), {}, tp=4) == 192
    assert _linear_width("ReplicatedLinear", (256, 512), {}, tp=4) == 512
    assert _linear_width("RowParallelLinear", (512, 256), {}, tp=4) == 256
    assert _linear_width("ColumnParallelLinear", (256, 510), {}, tp=4) is None  # vLLM would assert


# --- every file that passes at TP=1 passes at each TP --------------------------------------

# Every fixture file whose semantic level passes at TP=1 (dense_only has no site to run,
# two_candidates is refused; tp_total_widths is the one that must fail, below).
NOT_PASSING = ("dense_only", "two_candidates", "tp_total_widths")
PASSING = sorted(f"{name}/expected.py" for name in VARIANTS if name not in NOT_PASSING) + ["patched/model.py", "native/model.py", "native_stale_bypass/reverted.py"]


@pytest.mark.parametrize("name", PASSING)
def test_every_fixture_that_passes_at_tp_1_passes_at_each_tp(name: str, heads: tp.Heads) -> None:
    rows = semantic_rows(FIXTURES / name)
    sizes = [p.size for p in tp.plans(heads=heads)]
    assert list(rows) == ["semantic", *(f"semantic TP={n}" for n in sizes[1:])]
    for level, row in rows.items():
        assert row.status is Status.PASSED, f"{level}: {row.reason}\n" + "\n".join(row.details)
    # each rank ran, at its own sizes, and its checks are named by its rank
    last = sizes[2] - 1
    details = rows[f"semantic TP={sizes[2]}"].details
    assert any(f": sizes: rank {last} of TP={sizes[2]}: " in d for d in details), details
    assert any(f": rank {last}: fp8 cache " in d and d.endswith(": yes") for d in details), details


def test_a_file_whose_init_keeps_the_tp_1_sizes_says_so() -> None:
    """compiled_native's __init__ never asks the TP size (its counts are the config's): the
    rank's sizes still run the bypass, and the row says which of the file's own are TP=1's."""
    rows = semantic_rows(FIXTURES / "compiled_native" / "expected.py", tp_sizes=[2])
    row = rows["semantic TP=2"]
    assert row.status is Status.PASSED
    assert "__init__ computes TP=1 sizes: self.num_heads = " in row.reason
    assert "__init__ computes" not in rows["semantic"].reason


# --- slices with the TP=1 sizes: right at TP=1 only ----------------------------------------


def test_the_fixture_that_slices_with_the_tp_1_sizes_fails_at_each_tp_naming_tp_and_rank(heads) -> None:
    path = FIXTURES / "tp_total_widths" / "model.py"
    rows = semantic_rows(path)
    sharding, replicating = (p.size for p in tp.plans(heads=heads)[1:])
    assert rows["semantic"].status is Status.PASSED, rows["semantic"].reason
    for size in (sharding, replicating):
        row = rows[f"semantic TP={size}"]
        assert row.status is Status.FAILED
        assert row.reason.startswith(f"MiniMaxM3SparseAttention: TP={size} rank 0: "), row.reason


def test_cli_prints_each_tp_row_and_one_failure_line_naming_tp_and_rank() -> None:
    path = FIXTURES / "tp_total_widths" / "model.py"
    proc = cli("verify", "--tp", "2", "--json", str(path), env={"COLUMNS": "200"})
    assert proc.returncode == 1, proc.stderr
    levels = [(lv["level"], lv["status"]) for lv in json.loads(proc.stdout)["files"][0]["levels"]]
    assert levels[1:3] == [("semantic", "passed"), ("semantic TP=2", "failed")]
    assert any(
        line.startswith(f"{path}: semantic TP=2 failed: MiniMaxM3SparseAttention: TP=2 rank 0: ")
        for line in proc.stderr.splitlines()
    ), proc.stderr
    assert any(line.startswith("semantic TP=2 ") and "failed" in line for line in proc.stderr.splitlines())


def _edited(tmp_path: Path, fixture: str, old: str, new: str) -> Path:
    source = (FIXTURES / fixture / "expected.py").read_text()
    assert source.count(old) == 1, f"{old!r} no longer applies to {fixture}"
    path = tmp_path / "model.py"
    path.write_text(source.replace(old, new))
    return path


# fixture -> a line of its post-call block or _insert_kv, and the same with a TP=1 size
TP1_SIZES = {
    "q width of the model": (
        "amd_fork_era",
        "k = qkv[:, self.q_size : self.q_size + kv]",
        "k = qkv[:, self.total_num_heads * self.head_dim : self.total_num_heads * self.head_dim + kv]",
    ),
    "kv width of the model": (
        "amd_fork_era",
        "            kv = self.num_kv_heads * self.head_dim\n            k = qkv",
        "            kv = self.total_num_kv_heads * self.head_dim\n            k = qkv",
    ),
    "k viewed with the model's kv heads": (
        "separate_projections",
        "key.view(-1, self.num_kv_heads, self.head_dim)",
        "key.view(-1, self.total_num_kv_heads, self.head_dim)",
    ),
}


@pytest.mark.parametrize("case", sorted(TP1_SIZES))
def test_a_bypass_that_uses_a_tp_1_size_fails_at_tp_2_and_passes_at_tp_1(tmp_path: Path, case: str) -> None:
    fixture, old, new = TP1_SIZES[case]
    rows = semantic_rows(_edited(tmp_path, fixture, old, new), tp_sizes=[2])
    assert rows["semantic"].status is Status.PASSED, f"{case}: {rows['semantic'].reason}"
    row = rows["semantic TP=2"]
    assert row.status is Status.FAILED and "TP=2 rank 0: " in row.reason, f"{case}: {row.reason}"


def test_toncaos_narrowed_index_q_projection_is_run_at_every_rank(tmp_path: Path, monkeypatch) -> None:
    """The separate-projections layout narrows the replicated index_q projection to this rank's
    heads: `(tp_rank // num_kv_head_replicas) * index_q_size`. At TP=8 (two ranks a KV head) a
    start that forgets the replicas runs past the projection from rank 4 on: a chosen TP runs
    every rank, and the first that fails is named."""
    monkeypatch.setattr(tp, "model_heads", lambda: REAL)
    good = semantic_rows(FIXTURES / "separate_projections" / "expected.py", tp_sizes=[8])["semantic TP=8"]
    assert good.status is Status.PASSED, good.reason
    assert "TP=8 ranks 0, 1, 2, 3, 4, 5, 6, 7" in good.reason
    path = _edited(
        tmp_path,
        "separate_projections",
        "start = (self.tp_rank // self.num_kv_head_replicas) * self.index_q_size",
        "start = self.tp_rank * self.index_q_size",
    )
    rows = semantic_rows(path, tp_sizes=[2, 8])
    assert rows["semantic"].status is Status.PASSED and rows["semantic TP=2"].status is Status.PASSED
    bad = rows["semantic TP=8"]
    assert bad.status is Status.FAILED and "TP=8 rank 4: " in bad.reason, bad.reason


def test_tp_1_alone_is_the_one_semantic_row() -> None:
    rows = semantic_rows(FIXTURES / "patched" / "model.py", tp_sizes=[1])
    assert list(rows) == ["semantic"] and rows["semantic"].status is Status.PASSED


def test_the_kernel_level_runs_no_tp_whose_semantic_row_did_not_pass(monkeypatch) -> None:
    """The real kernels trust the sizes they are handed: on sizes the reference op rejects they
    can write out of bounds and end the process (seen on an H100: an illegal memory access,
    no report). A TP>1 row runs on the GPU only where the semantic level passed at that TP."""
    import rewriter.verify as verify_package
    from rewriter.targets import Target
    from rewriter.verify import KernelContext, LevelResult, Status, tp

    original = verify_package._semantic
    on_gpu: list[int] = []

    def semantic(path, classes, ctx, out=None, plan=None):  # type: ignore[no-untyped-def]
        if ctx is None:
            return original(path, classes, ctx, out, plan)
        on_gpu.append(plan.size if plan is not None else 1)
        return LevelResult("kernel" + (plan.label if plan is not None else ""), Status.PASSED, "stand-in GPU run")

    monkeypatch.setattr(verify_package, "_semantic", semantic)
    plans = tp.plans([2])
    target = Target(FIXTURES / "tp_total_widths" / "model.py", "test")
    out = verify_package.verify_file(target, kernel=KernelContext(ops=object()), plans=plans)
    levels = {level.level: level for level in out.levels}
    assert levels["semantic"].status is Status.PASSED and levels["semantic TP=2"].status is Status.FAILED
    assert on_gpu == [1]  # TP=1 ran on the GPU; TP=2 did not
    assert levels["kernel TP=2"].status is Status.SKIPPED and "did not pass" in levels["kernel TP=2"].reason
