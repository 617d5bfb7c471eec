"""`verify --engine` (rewriter/verify/engine.py): skip paths and the comparison, on CPU.

The engine itself needs a CUDA GPU and vLLM (bench/vllm024_engine.sh runs it on
the H200). Here: the child's skip answers, reached for real in a subprocess
with stand-in ``torch`` / ``vllm`` packages on its path; and the comparison and
the verdict on recorded reports (hand-made below).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rewriter.verify import Status, engine
from rewriter.verify.engine import (
    EngineOptions,
    compare_outputs,
    first_divergence,
    jobs_for,
    judge_results,
    max_logprob_delta,
    prefix_agreement,
    prompt_facts,
)

FILE = Path("/srv/vllm/vllm/models/minimax_m3/nvidia/model.py")


# ---- the comparison -----------------------------------------------------------------


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([7], [8]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a shorter run diverges where it stops
    assert first_divergence([], []) is None


def test_prefix_agreement_counts_only_the_common_prefix():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert (
        prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    )  # the match after the divergence does not count
    assert prefix_agreement([1, 2, 3, 4], [9, 2, 3, 4]) == 0.0
    assert prefix_agreement([], []) == 1.0


def test_max_logprob_delta_over_the_common_prefix():
    a = {"tokens": [1, 2, 3], "logprobs": [-0.5, -1.0, -2.0]}
    b = {"tokens": [1, 2, 4], "logprobs": [-0.6, -1.25, -9.0]}  # position 2 differs: not compared
    assert max_logprob_delta(a, b) == pytest.approx(0.25)
    c = {"tokens": [5, 2, 3], "logprobs": [-0.1, -1.0, -2.0]}
    assert max_logprob_delta(a, c) is None
    d = {"tokens": [1, 2, 3], "logprobs": [None, -1.5, -2.0]}  # a missing logprob is skipped
    assert max_logprob_delta(a, d) == pytest.approx(0.5)


def seqs(*token_lists, lp=-1.0):
    return [{"tokens": list(t), "logprobs": [lp] * len(t)} for t in token_lists]


def test_comparison_aggregates():
    a = seqs([1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9])
    b = seqs([1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9], lp=-1.5)
    c = compare_outputs("auto", a, "fp8", b)
    assert [s.first_divergence for s in c.sequences] == [None, 2, 0]
    assert c.identical == 1
    assert c.first_divergence == 0
    assert c.agreement == pytest.approx((1.0 + 0.5 + 0.0) / 3)
    assert c.max_dlogprob == pytest.approx(0.5)
    assert c.prompt_agreement is None  # recorded without prompt logprobs: greedy only
    assert c.garbage(threshold=0.6) and not c.garbage(threshold=0.5)
    js = c.to_json()
    assert js["identical"] == 1 and js["sequences"] == 3 and js["first_divergence"] == 0
    assert "1/3 sequences identical" in c.summary()
    with pytest.raises(ValueError):
        compare_outputs("auto", a, "fp8", b[:2])


def test_prompt_positions_are_compared_one_by_one():
    a = {"prompt_top1": [4, 5, 6, None, 8], "prompt_logprobs": [-1.0, -2.0, None, -3.0, -0.5]}
    b = {"prompt_top1": [4, 9, 6, 7, 8], "prompt_logprobs": [-1.25, -2.0, -9.0, -3.5, -0.5]}
    # a flip at one position does not count against the positions after it; a missing one is skipped
    assert prompt_facts(a, b) == (3, 4, pytest.approx(0.5))
    assert prompt_facts({"tokens": []}, b) == (0, 0, None)


def test_prompt_agreement_decides_garbage_where_greedy_tokens_agree():
    flat = [{"tokens": [1, 2], "logprobs": [-1.0, -1.0]}] * 2
    good = [dict(s, prompt_top1=[3, 4, 5, 6, 7], prompt_logprobs=[-1.0] * 5) for s in flat]
    off = [dict(s, prompt_top1=[3, 0, 0, 0, 7], prompt_logprobs=[-1.0] * 5) for s in flat]
    c = compare_outputs("auto", good, "fp8", off)
    assert c.identical == 2 and c.agreement == 1.0
    assert c.prompt_agreement == pytest.approx(4 / 10)
    assert c.garbage(prompt_threshold=0.5) and not c.garbage(prompt_threshold=0.4)
    js = c.to_json()
    assert js["prompt_agreement"] == 0.4 and js["prompt_positions"] == 10
    assert "prompt top-1 agreement 0.400" in c.summary()


def test_identical_runs():
    a = seqs([1, 2], [3, 4])
    c = compare_outputs("native", a, "bypass", a)
    assert c.identical == 2 and c.first_divergence is None and c.max_dlogprob == 0.0 and c.agreement == 1.0


# ---- the verdict, on recorded child reports -------------------------------------------

GOOD = seqs([1, 2, 3, 4, 5, 6, 7, 8], [2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 3, 3, 3, 3, 3, 3])
NOISY = seqs([1, 2, 3, 4, 5, 6, 0, 0], [2, 3, 4, 5, 6, 7, 8, 9], [3, 3, 3, 3, 3, 3, 3, 3])  # one late flip
GARBAGE = seqs([0, 0, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0], [0, 3, 3, 3, 3, 3, 3, 3])
ENV = {"vllm": "0.24.0", "gpu": "NVIDIA H200", "notes": []}


def ok(label, outputs, seconds=3.0):
    return {"label": label, "status": "ok", "phase": "done", "outputs": outputs, "seconds": seconds}


def raised(label, phase, exc_type, message, frames=(), tb=(), capture=False):
    return {
        "label": label,
        "status": "raised",
        "phase": phase,
        "exc_type": exc_type,
        "message": message,
        "frames": [list(f) for f in frames],
        "traceback": list(tb),
        "capture": capture,
        "seconds": 1.0,
    }


def report(*jobs):
    return {"status": "ok", "reason": "", "env": ENV, "jobs": list(jobs)}


def test_passes_when_fp8_agrees_with_bf16():
    r = judge_results(report(ok("file:auto", GOOD), ok("file:fp8_e4m3", NOISY)), FILE, [591])
    assert r.status == "passed", r.reason
    assert "0.24.0" in r.reason and "2/3 sequences identical" in r.reason
    assert len(r.comparisons) == 1


def test_garbage_fails():
    r = judge_results(report(ok("file:auto", GOOD), ok("file:fp8_e4m3", GARBAGE)), FILE, [591])
    assert r.status == "failed"
    assert r.reason.startswith("garbage: ")


def test_threshold_is_applied():
    recorded = report(ok("file:auto", GOOD), ok("file:fp8_e4m3", NOISY))
    assert judge_results(recorded, FILE, [591], min_agreement=0.95).status == "failed"
    assert judge_results(recorded, FILE, [591], min_agreement=0.5).status == "passed"


def test_raise_in_the_files_code_names_its_line():
    job = raised(
        "file:fp8_e4m3",
        "init",
        "NameError",
        "name 'insert_via_fused' is not defined",
        frames=[("/x/vllm/v1/worker/gpu_model_runner.py", 10), (str(FILE), 604)],
    )
    r = judge_results(report(ok("file:auto", GOOD), job), FILE, [591])
    assert r.status == "failed"
    assert "model.py:604" in r.reason and "NameError" in r.reason


def test_kernel_assert_through_compiled_code_points_at_the_insert_site():
    job = raised(
        "file:fp8_e4m3",
        "init",
        "RuntimeError",
        "auto kv_cache dtype must match qkv",
        frames=[("/x/torch/_ops.py", 1200)],
        tb=['  File "/x/torch/_ops.py", line 1200', "RuntimeError: auto kv_cache dtype must match qkv"],
    )
    r = judge_results(report(ok("file:auto", GOOD), job), FILE, [591])
    assert r.status == "failed"
    assert "model.py:591" in r.reason and "fused insert" in r.reason


def test_capture_failure_is_reported_as_such():
    job = raised(
        "file:fp8_e4m3",
        "init",
        "RuntimeError",
        "CUDA error: operation not permitted when stream is capturing",
        capture=True,
    )
    r = judge_results(report(ok("file:auto", GOOD), job), FILE, [])
    assert r.status == "failed" and "CUDA-graph capture failed" in r.reason


def test_no_model_class_is_skipped():
    msg = "no model class to serve: MiniMaxM3SparseForCausalLM is not defined in the file"
    jobs = [raised(label, "import", "LookupError", msg) for label in ("file:auto", "file:fp8_e4m3")]
    r = judge_results(report(*jobs), FILE, [276])
    assert r.status == "skipped" and "no model class" in r.reason


def test_import_error_of_the_file_is_judged_like_the_import_level():
    job = raised(
        "file:auto",
        "import",
        "NameError",
        "name 'foo' is not defined",
        frames=[("<frozen>", 1), (str(FILE), 12)],
    )
    r = judge_results(report(job, ok("file:fp8_e4m3", GOOD)), FILE, [])
    assert r.status == "failed" and "model.py:12" in r.reason


def test_native_run_is_compared_and_its_failure_is_not_the_files():
    both = report(ok("file:auto", GOOD), ok("file:fp8_e4m3", NOISY), ok("native:fp8_e4m3", NOISY))
    r = judge_results(both, FILE, [591])
    assert r.status == "passed"
    pairs = [(c.a, c.b) for c in r.comparisons]
    assert ("native:fp8_e4m3", "file:fp8_e4m3") in pairs and ("file:auto", "native:fp8_e4m3") in pairs
    bypass_vs_native = next(c for c in r.comparisons if c.a == "native:fp8_e4m3")
    assert bypass_vs_native.identical == 3
    broken = report(
        ok("file:auto", GOOD),
        ok("file:fp8_e4m3", NOISY),
        raised("native:fp8_e4m3", "init", "RuntimeError", "x"),
    )
    r = judge_results(broken, FILE, [591])
    assert r.status == "passed"
    assert any("own file failed too" in d for d in r.details)


def test_bypass_far_from_the_native_insert_fails():
    r = judge_results(
        report(ok("file:auto", GOOD), ok("file:fp8_e4m3", NOISY), ok("native:fp8_e4m3", GARBAGE)),
        FILE,
        [591],
    )
    assert r.status == "failed"
    assert "file:fp8_e4m3 vs native:fp8_e4m3" in r.reason
    assert "native:fp8_e4m3 vs file:auto" not in r.reason  # vLLM's own fp8 run is not judged


def test_a_configuration_vllm_refuses_for_its_own_file_is_skipped():
    msg = "No common block size for 16."
    refused = [raised(label, "init", "ValueError", msg) for label in ("file:auto", "file:fp8_e4m3", "native:fp8_e4m3")]
    r = judge_results(report(*refused), FILE, [591])
    assert r.status == "skipped" and "refuses this configuration for its own file too" in r.reason
    only_the_file = [raised(label, "init", "ValueError", msg) for label in ("file:auto", "file:fp8_e4m3")]
    assert judge_results(report(*only_the_file), FILE, [591]).status == "failed"
    other = report(*refused[:2], raised("native:fp8_e4m3", "init", "ValueError", "another"))
    assert judge_results(other, FILE, [591]).status == "failed"


def test_a_run_past_the_deadline_is_skipped_not_failed():
    late = {
        "label": "file:fp8_e4m3",
        "status": "not-run",
        "phase": "deadline",
        "message": "the time budget was spent",
    }
    r = judge_results(report(ok("file:auto", GOOD), late), FILE, [591])
    assert r.status == "skipped" and "not run" in r.reason


def test_skipped_and_crashed_reports():
    r = judge_results({"status": "skipped", "reason": "no CUDA GPU for /usr/bin/python3", "jobs": []}, FILE)
    assert r.status == "skipped" and "no CUDA" in r.reason
    r = judge_results(
        {"status": "failed", "reason": "python exited -11", "jobs": [], "traceback": ["Segmentation fault"]},
        FILE,
    )
    assert r.status == "failed" and r.details == ["Segmentation fault"]


def test_to_json():
    r = judge_results(report(ok("file:auto", GOOD), ok("file:fp8_e4m3", NOISY)), FILE, [591])
    js = json.loads(json.dumps(r.to_json()))
    assert js["status"] == "passed" and js["runs"][0]["label"] == "file:auto"
    assert js["comparisons"][0]["identical"] == 2


def test_jobs():
    opts = EngineOptions(block_size=16, backend="FLASH_ATTN", enforce_eager=True)
    jobs = jobs_for(FILE, None, opts)
    assert [(j["label"], j["kv_cache_dtype"]) for j in jobs] == [
        ("file:auto", "auto"),
        ("file:fp8_e4m3", "fp8_e4m3"),
    ]
    assert all(j["block_size"] == 16 and j["backend"] == "FLASH_ATTN" and j["enforce_eager"] for j in jobs)
    jobs = jobs_for(FILE, Path("/o/model.py"), EngineOptions())
    assert jobs[-1] == {
        "label": "native:fp8_e4m3",
        "file": "/o/model.py",
        "kv_cache_dtype": "fp8_e4m3",
        "block_size": 128,
        "backend": "TRITON_ATTN",
        "enforce_eager": False,
    }


# ---- the child's skip paths, for real in a subprocess -----------------------------------

FAKE_TORCH = """
__version__ = "0.0-stub"
class cuda:
    @staticmethod
    def is_available(): return {cuda}
    @staticmethod
    def get_device_name(i=0): return "Stub GPU"
    @staticmethod
    def get_device_capability(i=0): return (9, 0)
"""


def stub_env(tmp_path, monkeypatch, torch="ok", vllm=None):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    if torch == "missing":
        (site / "torch" / "__init__.py").write_text("raise ImportError('No module named torch (stub)')\n")
    else:
        (site / "torch" / "__init__.py").write_text(FAKE_TORCH.format(cuda=torch == "ok"))
    if vllm is not None:
        (site / "vllm").mkdir()
        (site / "vllm" / "__init__.py").write_text(vllm)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")


def child(spec=None):
    return engine.run_child(spec or {"jobs": []}, python=sys.executable, timeout=60)


@pytest.fixture
def no_real_vllm():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("this interpreter has a vLLM: the stand-ins would not be the only ones")


def test_child_skips_without_torch(tmp_path, monkeypatch):
    stub_env(tmp_path, monkeypatch, torch="missing")
    out = child()
    assert out["status"] == "skipped", out
    assert "torch is not importable" in out["reason"]


def test_child_skips_without_gpu(tmp_path, monkeypatch):
    stub_env(tmp_path, monkeypatch, torch="nogpu")
    out = child()
    assert out["status"] == "skipped" and "no CUDA GPU" in out["reason"], out


def test_child_skips_without_vllm(tmp_path, monkeypatch, no_real_vllm):
    stub_env(tmp_path, monkeypatch, torch="ok")
    out = child()
    assert out["status"] == "skipped" and "vllm is not installed" in out["reason"], out
    assert out["env"]["gpu"] == "Stub GPU"


def test_child_skips_when_vllm_cannot_be_imported(tmp_path, monkeypatch):
    stub_env(
        tmp_path,
        monkeypatch,
        torch="ok",
        vllm="raise RuntimeError('libcuda.so.1: cannot open shared object file')\n",
    )
    out = child()
    assert out["status"] == "skipped", out
    assert "vLLM cannot be imported here" in out["reason"] and "libcuda" in out["reason"]


def test_engine_level_without_a_gpu_is_skipped(tmp_path, monkeypatch):
    stub_env(tmp_path, monkeypatch, torch="nogpu")
    monkeypatch.setattr(engine, "installed_original", lambda path, python: None)
    level, res = engine.engine_level(FILE, [591], python=sys.executable)
    assert level.level == "engine" and level.status is Status.SKIPPED
    assert "no CUDA GPU" in level.reason
    assert res.to_json()["status"] == "skipped"


def test_child_crash_is_a_failure(tmp_path):
    out = engine.run_child({"jobs": []}, python=str(tmp_path / "no-such-python"), timeout=10)
    assert out["status"] == "failed"


# ---- the tiny checkpoint (needs torch; no vLLM) ------------------------------------------


def load_child():
    spec = importlib.util.spec_from_file_location("mm3_engine_child", engine.CHILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_child_keeps_this_folder_off_sys_path():
    # run as a script its folder would be sys.path[0], and rewriter/verify/kernels.py would
    # shadow the `kernels` package transformers looks for
    src = engine.CHILD.read_text()
    assert "del sys.path[0]" in src.split("def ", 1)[0]


def test_checkpoint_names_and_shapes():
    pytest.importorskip("torch")
    c = load_child()
    cfg = c.tiny_config({"num_local_experts": 4}, 256)
    assert cfg["architectures"] == ["MiniMaxM3SparseForCausalLM"] and cfg["model_type"] == "minimax_m3_text"
    t = c.checkpoint_tensors(cfg, 0.02, 0)
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (cfg["dense_intermediate_size"], H)
    assert "model.layers.0.self_attn.index_k_proj.weight" not in t  # layer 0 is dense attention
    assert t["model.layers.1.self_attn.index_k_proj.weight"].shape == (128, H)  # one index-key head
    assert t["model.layers.1.self_attn.index_q_proj.weight"].shape == (2 * 128, H)
    assert t["model.layers.2.self_attn.k_proj.weight"].shape == (cfg["num_key_value_heads"] * hd, H)
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in t
    assert "model.layers.2.block_sparse_moe.experts.4.w2.weight" not in t
    w = t["model.layers.1.self_attn.q_proj.weight"].float()
    assert 0.018 < w.std().item() < 0.022  # the realistic scale
    again = c.checkpoint_tensors(cfg, 0.02, 0)
    assert all((again[k] == v).all() for k, v in t.items())  # seeded
    p = c.prompts([5, 1100], 256, 0)
    assert [len(x) for x in p] == [5, 1100] and all(0 < i < 256 for i in p[1])


# ---- capacity: the KV cache each engine allocated ----------------------------------------


def vllm024_llm(blocks=900, block_size=128, tensors=(1_000_000, 500_000), inproc=True):
    """An object shaped as vLLM 0.24's ``LLM`` after init, in the places the child reads:
    ``llm_engine.vllm_config.cache_config`` (the engine core sets ``num_gpu_blocks``,
    ``block_size``, ``kv_cache_size_tokens`` there) and, with the core in this process,
    ``llm_engine.engine_core.engine_core`` (its profiled memory and its scheduler's
    ``kv_cache_config``)."""
    from types import SimpleNamespace as NS

    cache = NS(
        num_gpu_blocks=blocks,
        block_size=block_size,
        kv_cache_size_tokens=blocks * block_size,
        kv_cache_max_concurrency=blocks * block_size / 2048,
        cache_dtype="fp8_e4m3",
    )
    spec = type("FullAttentionSpec", (), {"page_size_bytes": 4096})()
    kv_config = NS(
        kv_cache_tensors=[NS(size=n, shared_by=["l"]) for n in tensors],
        kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["model.layers.0.self_attn.attn"])],
    )
    core = NS(available_gpu_memory_for_kv_cache=1_600_000, scheduler=NS(kv_cache_config=kv_config))
    engine_core = NS(engine_core=core) if inproc else NS()  # InprocClient / a core process's client
    return NS(llm_engine=NS(vllm_config=NS(cache_config=cache), engine_core=engine_core))


def test_child_reads_the_capacity_the_engine_allocated():
    c = load_child()
    cap = c.kv_capacity(vllm024_llm(), 0.25)
    assert cap["blocks"] == 900 and cap["block_size"] == 128 and cap["tokens"] == 900 * 128
    assert cap["vllm_tokens"] == 900 * 128 and cap["gpu_memory_utilization"] == 0.25
    assert cap["kv_bytes"] == 1_500_000 and cap["available_bytes"] == 1_600_000
    assert cap["groups"] == ["FullAttentionSpec: 1 layer(s), 4096 B a block"]
    json.dumps(cap)  # one JSON line
    # the engine core in a process of its own: the config's numbers still come back
    cap = c.kv_capacity(vllm024_llm(inproc=False), 0.25)
    assert cap["tokens"] == 900 * 128 and cap["kv_bytes"] is None and cap["available_bytes"] is None
    # a vLLM without these attributes: None, never a raise
    cap = c.kv_capacity(object(), 0.5)
    assert cap["blocks"] is None and cap["tokens"] is None and cap["gpu_memory_utilization"] == 0.5


def test_the_child_reads_vllm_024s_own_attributes():
    """Where vLLM 0.24.0 sets what the child reads (its wheel's source)."""
    import zipfile

    from test_real_wheels import vllm_wheel

    with zipfile.ZipFile(vllm_wheel("0.24.0")) as wheel:
        core = wheel.read("vllm/v1/engine/core.py").decode()
        cache = wheel.read("vllm/config/cache.py").decode()
        llm = wheel.read("vllm/entrypoints/llm.py").decode()
        client = wheel.read("vllm/v1/engine/core_client.py").decode()
        sched = wheel.read("vllm/v1/core/sched/scheduler.py").decode()
    assert "vllm_config.cache_config.num_gpu_blocks = scheduler_kv_cache_config.num_blocks" in core
    assert "vllm_config.cache_config.kv_cache_size_tokens = num_tokens" in core
    assert "self.available_gpu_memory_for_kv_cache = available_gpu_memory[0]" in core
    assert "num_gpu_blocks: int | None" in cache and "kv_cache_size_tokens: int | None" in cache
    assert "self.llm_engine = LLMEngine.from_engine_args(" in llm
    assert "class InprocClient" in client and "self.engine_core = EngineCore(" in client
    assert "self.kv_cache_config = kv_cache_config" in sched


def cap(label, blocks, block_size=128, util=0.25, kv_bytes=None):
    return {
        "label": label,
        "capacity": {
            "blocks": blocks,
            "block_size": block_size,
            "gpu_memory_utilization": util,
            "kv_bytes": kv_bytes,
            "vllm_tokens": blocks and blocks * block_size,
        },
    }


def test_capacity_ratio_needs_the_same_memory_share():
    bf16 = engine.Capacity.of(cap("file:auto", 1000, kv_bytes=128_000 * 2304))
    fp8 = engine.Capacity.of(cap("file:fp8_e4m3", 1800))
    assert bf16.tokens == 128_000 and bf16.bytes_per_token == 2304
    assert engine.capacity_ratio(bf16, fp8) == pytest.approx(1.8)
    other = engine.Capacity.of(cap("file:fp8_e4m3", 1800, util=0.5))
    assert engine.capacity_ratio(bf16, other) is None  # another share of memory: no ratio
    assert engine.capacity_ratio(bf16, None) is None
    assert engine.Capacity.of({"label": "x"}) is None  # no capacity reported (an older child)
    assert engine.Capacity.of(cap("x", None)) is None  # the engine set no block count
    assert engine.Capacity.of(cap("x", 0)) is None


def test_capacity_in_the_verdict_and_the_json():
    jobs = [
        ok("file:auto", GOOD) | cap("file:auto", 1000),
        ok("file:fp8_e4m3", NOISY) | cap("file:fp8_e4m3", 1800),
        ok("native:fp8_e4m3", GOOD) | cap("native:fp8_e4m3", 1800),
    ]
    r = judge_results(report(*jobs), FILE, [591])
    line = "KV cache at gpu_memory_utilization 0.25: bf16 128,000 tokens (1,000 blocks x 128), "
    line += "fp8 230,400 tokens (1,800 x 128): 1.80x"
    assert r.status == "passed" and line in r.reason and line in r.details
    assert "KV cache of the installed vLLM's own file with fp8: 1.80x bf16's tokens" in r.details
    js = json.loads(json.dumps(r.to_json()))
    assert js["capacity"]["fp8_over_bf16"] == 1.8 and js["capacity"]["native_fp8_over_bf16"] == 1.8
    assert js["capacity"]["runs"]["file:auto"]["tokens"] == 128_000
    assert js["runs"][1]["capacity"]["blocks"] == 1800
    # reported whatever the verdict: the fp8 run is garbage, its capacity is still there
    bad = judge_results(report(jobs[0], ok("file:fp8_e4m3", GARBAGE) | cap("file:fp8_e4m3", 1800)), FILE, [591])
    assert bad.status == "failed" and line in bad.details and line not in bad.reason
    # no capacity reported: none claimed
    plain = judge_results(report(ok("file:auto", GOOD), ok("file:fp8_e4m3", NOISY)), FILE, [591])
    assert "KV cache" not in plain.reason and plain.to_json()["capacity"] is None


# ---- wired into `verify` (--engine) -----------------------------------------------------


def test_verify_engine_flag_adds_the_level():
    """Here (no CUDA GPU, or no torch, and no vLLM) the engine level is there and, asked for by
    --engine, fails with the reason it could not run (it was skipped, exit 0)."""
    from conftest import FIXTURES, cli

    target = str(FIXTURES / "patched" / "model.py")
    proc = cli("verify", target, "--engine", "--engine-block-size", "16", "--json")
    report = json.loads(proc.stdout)
    levels = {lv["level"]: lv for lv in report["files"][0]["levels"]}
    assert levels["engine"]["status"] == "failed", levels["engine"]
    assert proc.returncode == 1 and levels["engine"]["reason"].endswith("(--engine)")
    assert (
        "no CUDA GPU" in levels["engine"]["reason"] or "torch is not importable" in levels["engine"]["reason"]
    )
    assert report["files"][0]["engine"]["status"] == "skipped"
    plain = json.loads(cli("verify", target, "--json").stdout)
    assert "engine" not in {lv["level"] for lv in plain["files"][0]["levels"]}


def test_each_job_runs_in_a_process_of_its_own_and_a_skip_stops_the_rest(monkeypatch) -> None:
    """vLLM does not clean up for a second LLM in one process (seen on the H200): one child a job."""
    specs = []

    def fake(spec, python=None, timeout=0):
        specs.append(spec)
        (job,) = spec["jobs"]
        if job["label"] == "stop":
            return {"status": "skipped", "reason": "no GPU", "jobs": []}
        return {"status": "ok", "env": {"n": len(specs)}, "jobs": [{"label": job["label"], "status": "ok"}]}

    monkeypatch.setattr(engine, "run_child", fake)
    merged = engine.run_jobs([{"label": "a"}, {"label": "b"}], {"new_tokens": 4}, None, 1)
    assert [s["jobs"] for s in specs] == [[{"label": "a"}], [{"label": "b"}]]
    assert all(s["new_tokens"] == 4 for s in specs)
    assert merged["status"] == "ok" and [j["label"] for j in merged["jobs"]] == ["a", "b"]
    assert merged["env"] == {"n": 1}
    specs.clear()
    stopped = engine.run_jobs([{"label": "stop"}, {"label": "never"}], {}, None, 1)
    assert stopped["status"] == "skipped" and len(specs) == 1


# ---- what to do next ---------------------------------------------------------------


def _printed(levels) -> str:
    import io

    from rich.console import Console

    from rewriter.verify import FileVerification, LevelResult, VerifyReport
    from rewriter.verify.table import print_verify

    buf = io.StringIO()
    files = [FileVerification(FILE, "path", levels=[LevelResult(n, s, "why") for n, s in levels])]
    print_verify(VerifyReport(files), Console(file=buf, width=200))
    return buf.getvalue()


def test_the_launch_line_follows_a_passing_engine_level_only():
    from rewriter.report import FP8_LAUNCH

    assert "--kv-cache-dtype fp8_e4m3" in FP8_LAUNCH and "--attention-backend TRITON_ATTN" in FP8_LAUNCH
    assert FP8_LAUNCH in _printed([("import", Status.PASSED), ("engine", Status.PASSED)])
    assert FP8_LAUNCH not in _printed([("import", Status.PASSED), ("engine", Status.FAILED)])
    assert FP8_LAUNCH not in _printed([("import", Status.PASSED), ("kernel", Status.PASSED)])


# ---- the verdict on a real device run's outputs -------------------------------------
# bench/vllm024_engine.py with vLLM 0.24.0 on an H100 (its outputs bit-identical to the
# H200's), trimmed by bench/engine_testdata.py: the rewritten file's bf16 and fp8 runs,
# 0.24.0's own file's native fp8 run, the fork-era file's fp8 run, and known-broken
# bypasses (cache never written; written one slot off).

RECORDED = json.loads((Path(__file__).parent / "data" / "engine_h100_v024.json").read_text())


def recorded(tmp_path, fp8: str = "rewritten:fp8_e4m3") -> tuple[dict, Path]:
    """A child's report from the recorded runs, ``fp8`` as the file's fp8 run; the frames
    in the verified file point at a file of the test's own."""
    file = tmp_path / "model.py"
    file.write_text("# the verified file\n")
    runs = RECORDED["runs"]

    def job(run: str, label: str) -> dict:
        j = json.loads(json.dumps(runs[run]).replace("<file>", str(file)))
        return {**j, "label": label}

    jobs = [job("rewritten:auto", "file:auto"), job(fp8, "file:fp8_e4m3"), job("native:fp8_e4m3", "native:fp8_e4m3")]
    return {"status": "ok", "reason": "", "env": RECORDED["env"], "jobs": jobs}, file


def test_recorded_the_rewritten_file_passes(tmp_path):
    res, file = recorded(tmp_path)
    r = judge_results(res, file, [591])
    assert r.status == "passed", r.reason
    assert "vllm 0.24.0" in r.reason


@pytest.mark.parametrize("broken", ["unwritten:fp8_e4m3", "shifted:fp8_e4m3"])
def test_recorded_broken_caches_are_garbage(tmp_path, broken):
    res, file = recorded(tmp_path, broken)
    r = judge_results(res, file, [591])
    assert r.status == "failed" and r.reason.startswith("garbage: "), r.reason


def test_recorded_limits_lie_between_the_fp8_noise_and_a_cache_one_slot_off():
    """The prompt limit catches what the greedy limit cannot: one slot off keeps a greedy
    prefix over the greedy limit, yet falls under the prompt one; the native insert's own
    fp8 noise clears both."""
    runs = {k: v.get("outputs") for k, v in RECORDED["runs"].items()}
    bf16 = runs["rewritten:auto"]
    floor = compare_outputs("bf16", bf16, "native", runs["native:fp8_e4m3"])
    bypass = compare_outputs("bf16", bf16, "bypass", runs["rewritten:fp8_e4m3"])
    shifted = compare_outputs("bf16", bf16, "shifted", runs["shifted:fp8_e4m3"])
    for fp8 in (floor, bypass):
        assert fp8.prompt_agreement >= engine.MIN_PROMPT_AGREEMENT and fp8.agreement >= engine.MIN_AGREEMENT
    assert shifted.agreement >= engine.MIN_AGREEMENT > 0
    assert shifted.prompt_agreement < engine.MIN_PROMPT_AGREEMENT
    assert shifted.prompt_positions == floor.prompt_positions == sum(len(o["prompt_top1"]) for o in bf16)


def test_recorded_fork_era_fp8_run_fails_at_the_insert_call(tmp_path):
    """0.24.0's file made fork-era (no kv_cache_dtype argument): the kernel's bf16-only
    assert, raised while vLLM captured the model, reported at the file's line."""
    res, file = recorded(tmp_path, "fork-era:fp8_e4m3")
    r = judge_results(res, file, [591])
    assert r.status == "failed"
    assert "model.py:591" in r.reason and "kv_cache dtype must match qkv" in r.reason


def test_recorded_capacity_fp8_holds_1_75_times_the_tokens(tmp_path):
    """The KV cache vLLM 0.24.0 allocated on the H100 at gpu_memory_utilization 0.8: the same
    bytes for every run, 3,584 bytes a token with a bf16 cache (three layers' K/V, 2 heads x
    128 x 2 bytes x 2, and two sparse layers' bf16 index keys, 128 x 2 bytes) against 2,048
    with fp8 (the index cache stays bf16): 1.75x the tokens, the bypass and the native insert
    alike; the level says so."""
    caps = {k: engine.Capacity.of(v) for k, v in RECORDED["runs"].items()}
    bf16, fp8, native = caps["rewritten:auto"], caps["rewritten:fp8_e4m3"], caps["native:fp8_e4m3"]
    assert (bf16.blocks, bf16.block_size, bf16.tokens) == (147_604, 128, 18_893_312)
    assert (fp8.blocks, fp8.tokens) == (258_307, 33_063_296) and native.tokens == fp8.tokens
    assert bf16.tokens == bf16.vllm_tokens and fp8.tokens == fp8.vllm_tokens  # one KV-cache group
    assert bf16.kv_bytes == fp8.kv_bytes and bf16.gpu_memory_utilization == 0.8
    assert (bf16.bytes_per_token, fp8.bytes_per_token) == (3 * 2 * 128 * 2 * 2 + 2 * 128 * 2, 3 * 2 * 128 * 2 + 2 * 128 * 2)
    assert engine.capacity_ratio(bf16, fp8) == pytest.approx(1.75, abs=1e-4)
    assert caps["fork-era:fp8_e4m3"] is None  # raised while vLLM built the engine: no LLM to read
    res, file = recorded(tmp_path)
    r = judge_results(res, file, [591])
    assert r.status == "passed"
    assert "bf16 18,893,312 tokens (147,604 blocks x 128), fp8 33,063,296 tokens (258,307 x 128): 1.75x" in r.reason
    assert r.to_json()["capacity"]["fp8_over_bf16"] == pytest.approx(1.75, abs=1e-4)
