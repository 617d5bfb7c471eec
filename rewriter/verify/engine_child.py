"""The engine level's heavy part: run in the target interpreter, needs only torch and vLLM.

Self-contained on purpose (no import of mm3-codemod): ``python engine_child.py SPEC.json``
with the interpreter whose vLLM is verified. It serves a tiny random-weight
MiniMax-M3 through ``vllm.LLM`` (the offline engine, in this process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model class registered here is the
one the worker builds), once per job of the spec, and prints ONE JSON line on
stdout - everything vLLM logs goes to stderr. Each job:
``{"label", "file", "kv_cache_dtype", "block_size", "backend", "enforce_eager"}``;
the file's model class is loaded as ``vllm.models.minimax_m3.nvidia._mm3_engine_<n>``
(so its absolute and relative imports resolve in the installed package) and
registered under vLLM's own architecture name. The spec's other keys: see
``DEFAULTS``. The result::

    {"status": "ok" | "skipped", "reason", "env": {...},
     "jobs": [{"label", "status": "ok" | "raised", "phase", "exc_type", "message",
               "frames": [[file, line], ...], "traceback": [...],
               "outputs": [{"tokens": [...], "logprobs": [...], "prompt_top1": [...],
                            "prompt_logprobs": [...]}], "seconds", "notes",
               "capacity": {"blocks", "block_size", "tokens", "vllm_tokens", "max_concurrency",
                            "gpu_memory_utilization", "cache_dtype", "kv_bytes",
                            "available_bytes", "groups"}}]}

The parent (:mod:`rewriter.verify.engine`) compares the jobs' outputs.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback

# Run as a script, this folder is sys.path[0]: its kernels.py, semantic.py ... would
# shadow the installed packages of those names (transformers imports `kernels`).
if sys.path and os.path.realpath(sys.path[0] or os.curdir) == os.path.dirname(os.path.realpath(__file__)):
    del sys.path[0]

ARCH = "MiniMaxM3SparseForCausalLM"  # vLLM's own name: its name-keyed logic stays as it is
DEFAULTS = {
    "new_tokens": 16,
    "seed": 0,
    "gpu_memory_utilization": 0.25,
    "max_model_len": 2048,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,  # prompts over 512 tokens are prefilled in chunks
    "capture_sizes": [1, 2, 4, 8, 16],  # 14 prompts decode as a batch padded to 16
    "prompt_lengths": [5, 9, 17, 33, 64, 100, 130, 200, 257, 300, 400, 640, 900, 1100],
    "vocab": 1024,
    "std": 0.02,
    "config": {},  # overrides of the tiny config below
    "workdir": None,
    "deadline": None,  # time.time() after which no further job starts (reported "not-run")
}
# 3 decoder layers: layer 0 dense attention + dense MLP; 1 and 2 sparse attention
# (the fused insert site) + MoE. Head and index dims as in the real model (the
# kernels are built for them); 16 q heads over 2 kv heads (a group of 8, the real
# model's per-rank group at TP 8); 4 top-k blocks, so prompts longer than
# 4 x 128 tokens attend sparsely.
TINY = {
    "hidden_size": 512,
    "intermediate_size": 256,
    "dense_intermediate_size": 512,
    "shared_intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 4096,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_mtp_modules": 0,
    "moe_layer_freq": [0, 1, 1],
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 2,
        "sparse_topk_blocks": 4,
        "sparse_block_size": 128,
        "sparse_disable_index_value": [0, 1, 1],
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": 1,
        "sparse_attention_freq": [0, 1, 1],
    },
    "torch_dtype": "bfloat16",
}

_report = sys.stdout


def emit(out: dict) -> None:
    print(json.dumps(out), file=_report)
    _report.flush()
    os._exit(0)  # no atexit hook of vLLM runs after the report


def exc_facts(exc: BaseException, phase: str) -> dict:
    tb = traceback.extract_tb(exc.__traceback__)
    text = traceback.format_exception(type(exc), exc, exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    while cause is not None:  # frames of the exception vLLM wrapped (EngineCore init, say)
        tb = list(tb) + list(traceback.extract_tb(cause.__traceback__))
        cause = cause.__cause__ or cause.__context__
    msg = str(exc).strip()
    return {
        "status": "raised",
        "phase": phase,
        "exc_type": type(exc).__name__,
        "message": msg.splitlines()[0][:500] if msg else "",
        "frames": [[f.filename, f.lineno] for f in tb],
        "traceback": "".join(text).splitlines()[-40:],
    }


def tiny_config(overrides: dict, vocab: int) -> dict:
    cfg = json.loads(json.dumps(TINY))
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    cfg["vocab_size"] = vocab
    cfg["architectures"] = [ARCH]
    cfg["model_type"] = "minimax_m3_text"
    return cfg


def checkpoint_tensors(cfg: dict, std: float, seed: int) -> dict:
    """The checkpoint's tensors under the MiniMax-M3 checkpoint's names, normal(0, std).

    Names as vLLM 0.24.0's ``MiniMaxM3Model.load_weights`` reads them; a name the
    model does not take or a parameter left unloaded makes vLLM's loader raise.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sp = cfg["sparse_attention_config"]
    nidx, idim = sp["sparse_num_index_heads"], sp["sparse_index_dim"]
    E, inter = cfg["num_local_experts"], cfg["intermediate_size"]
    shared = inter * cfg["n_shared_experts"]
    out: dict = {}

    def w(name: str, *shape: int, dtype=bf16) -> None:
        out[name] = (torch.randn(*shape, generator=g) * std).to(dtype)

    w("model.embed_tokens.weight", V, H)
    w("lm_head.weight", V, H)
    w("model.norm.weight", H)
    sparse_ids = {i for i, f in enumerate(sp["sparse_attention_freq"]) if f}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w(f"{p}.input_layernorm.weight", H)
        w(f"{p}.post_attention_layernorm.weight", H)
        a = f"{p}.self_attn"
        w(f"{a}.q_proj.weight", nh * hd, H)
        w(f"{a}.k_proj.weight", nkv * hd, H)
        w(f"{a}.v_proj.weight", nkv * hd, H)
        w(f"{a}.o_proj.weight", H, nh * hd)
        w(f"{a}.q_norm.weight", hd)
        w(f"{a}.k_norm.weight", hd)
        if i in sparse_ids:
            w(f"{a}.index_q_proj.weight", nidx * idim, H)
            w(f"{a}.index_k_proj.weight", idim, H)
            w(f"{a}.index_q_norm.weight", idim)
            w(f"{a}.index_k_norm.weight", idim)
        if cfg["moe_layer_freq"][i]:
            m = f"{p}.block_sparse_moe"
            w(f"{m}.gate.weight", E, H, dtype=torch.float32)
            w(f"{m}.e_score_correction_bias", E, dtype=torch.float32)
            for e in range(E):
                w(f"{m}.experts.{e}.w1.weight", inter, H)
                w(f"{m}.experts.{e}.w3.weight", inter, H)
                w(f"{m}.experts.{e}.w2.weight", H, inter)
            if shared:
                w(f"{m}.shared_experts.gate_proj.weight", shared, H)
                w(f"{m}.shared_experts.up_proj.weight", shared, H)
                w(f"{m}.shared_experts.down_proj.weight", H, shared)
        else:
            d = cfg["dense_intermediate_size"]
            w(f"{p}.mlp.gate_proj.weight", d, H)
            w(f"{p}.mlp.up_proj.weight", d, H)
            w(f"{p}.mlp.down_proj.weight", H, d)
    return out


def write_checkpoint(folder: str, cfg: dict, std: float, seed: int) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file(checkpoint_tensors(cfg, std, seed), os.path.join(folder, "model.safetensors"))


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


_loaded: dict[str, type] = {}


def load_model_class(path: str) -> type:
    """The file's causal-LM class, from the file loaded inside the installed nvidia package."""
    real = os.path.realpath(path)
    if real in _loaded:
        return _loaded[real]
    import vllm.models.minimax_m3.nvidia as pkg

    name = f"{pkg.__name__}._mm3_engine_{len(_loaded)}"
    spec = importlib.util.spec_from_file_location(name, real)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    classes = [
        obj
        for key, obj in vars(mod).items()
        if isinstance(obj, type) and obj.__module__ == name and key.endswith("ForCausalLM")
    ]
    cls = getattr(mod, ARCH, None) if getattr(getattr(mod, ARCH, None), "__module__", None) == name else None
    cls = cls or (classes[0] if len(classes) == 1 else None)
    if cls is None:
        found = ", ".join(c.__name__ for c in classes) or "none"
        raise LookupError(
            f"no model class to serve: {ARCH} is not defined in the file (ForCausalLM classes: {found})"
        )
    _loaded[real] = cls
    return cls


def sequence_facts(out, prompt: list[int]) -> dict:
    """One request's output: the greedy tokens and their logprobs, and per prompt position
    after the first the model's top-1 token and the prompt token's logprob (prefill with
    the cache - chunked for long prompts - so a wrong cache shows at every position)."""

    def logprob(d, tok):
        return float(d[tok].logprob) if d and tok in d else None

    c = out.outputs[0]
    top1, plps = [], []
    for tok, d in zip(prompt[1:], list(out.prompt_logprobs or [])[1:]):
        top1.append(int(min(d.items(), key=lambda kv: kv[1].rank)[0]) if d else None)
        plps.append(logprob(d, tok))
    return {
        "tokens": list(c.token_ids),
        "logprobs": [logprob(d, tok) for tok, d in zip(c.token_ids, c.logprobs or [])],
        "prompt_top1": top1,
        "prompt_logprobs": plps,
    }


def kv_capacity(llm, utilization: float) -> dict:
    """What the engine allocated for the KV cache once it was built (vLLM 0.24's own numbers):
    ``blocks`` (``cache_config.num_gpu_blocks``, set by the engine core after profiling) of
    ``block_size`` tokens each, ``tokens`` = their product; vLLM's group-aware capacity
    (``kv_cache_size_tokens``) beside it; and, with the engine core in this process, the
    bytes of the KV-cache tensors and the memory the profile left for them. Any number
    vLLM does not expose is None."""
    out: dict = {"gpu_memory_utilization": utilization}
    engine = getattr(llm, "llm_engine", None)
    cache = getattr(getattr(engine, "vllm_config", None), "cache_config", None)
    for key, attr in (
        ("blocks", "num_gpu_blocks"),
        ("block_size", "block_size"),
        ("vllm_tokens", "kv_cache_size_tokens"),
        ("max_concurrency", "kv_cache_max_concurrency"),
        ("cache_dtype", "cache_dtype"),
    ):
        value = getattr(cache, attr, None)
        out[key] = value if value is None or isinstance(value, (int, float, str)) else str(value)
    blocks, size = out["blocks"], out["block_size"]
    out["tokens"] = blocks * size if isinstance(blocks, int) and isinstance(size, int) else None
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient's
    available = getattr(core, "available_gpu_memory_for_kv_cache", None)
    out["available_bytes"] = int(available) if isinstance(available, (int, float)) and available > 0 else None
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    try:
        out["kv_bytes"] = sum(int(t.size) for t in config.kv_cache_tensors)
        out["groups"] = [
            f"{type(g.kv_cache_spec).__name__}: {len(g.layer_names)} layer(s), "
            f"{getattr(g.kv_cache_spec, 'page_size_bytes', '?')} B a block"
            for g in config.kv_cache_groups
        ]
    except Exception:
        out["kv_bytes"], out["groups"] = None, None
    return out


def cleanup(llm) -> None:
    import torch

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    gc.collect()
    torch.cuda.empty_cache()


def run_job(job: dict, spec: dict, ckpt: str, batch: list[list[int]]) -> dict:
    import torch

    res: dict = {"label": job["label"], "notes": []}
    t0 = time.perf_counter()
    cls = None
    try:
        if job.get("file"):  # else vLLM imports its installed module itself (bench/plugin_engine.py)
            cls = load_model_class(job["file"])
    except BaseException as exc:
        return res | exc_facts(exc, "import") | {"seconds": round(time.perf_counter() - t0, 2)}
    from vllm import LLM, ModelRegistry, SamplingParams

    if cls is not None:
        ModelRegistry.register_model(ARCH, cls)
    kwargs = dict(
        model=ckpt,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype=job["kv_cache_dtype"],
        block_size=job["block_size"],
        enforce_eager=job["enforce_eager"],
        gpu_memory_utilization=spec["gpu_memory_utilization"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        seed=spec["seed"],
    )
    if job.get("backend"):
        kwargs["attention_config"] = {"backend": job["backend"]}
    if not job["enforce_eager"]:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": spec["capture_sizes"]}
    llm = None
    phase = "init"  # model build, weight load, profile run, KV-cache allocation, CUDA-graph capture
    try:
        llm = LLM(**kwargs)
        try:
            res["capacity"] = kv_capacity(llm, spec["gpu_memory_utilization"])
        except Exception as exc:  # the capacity is reported, never the run's failure
            res["capacity"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        phase = "generate"
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=spec["new_tokens"],
            logprobs=0,
            prompt_logprobs=1,  # teacher-forced: every prompt position, read back through the cache
            ignore_eos=True,
            detokenize=False,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_tqdm=False)
        res["outputs"] = [sequence_facts(o, p) for o, p in zip(outs, batch)]
        res["status"] = "ok"
        res["phase"] = "done"
    except BaseException as exc:
        res |= exc_facts(exc, phase)
        res["capture"] = phase == "init" and any(
            "capture" in line.lower() or "cudagraph" in line.lower() for line in res["traceback"]
        )
    finally:
        res["seconds"] = round(time.perf_counter() - t0, 2)
        if llm is not None:
            cleanup(llm)
        else:
            gc.collect()
            torch.cuda.empty_cache()
    return res


def main() -> None:
    sys.stdout = sys.stderr  # vLLM logs to stdout: keep it off the report line
    spec = dict(DEFAULTS)
    with open(sys.argv[1]) as f:
        spec |= json.load(f)
    env: dict = {"python": sys.executable}
    try:
        import torch
    except BaseException as exc:
        emit(
            {
                "status": "skipped",
                "reason": f"torch is not importable from {sys.executable}: {exc}",
                "env": env,
                "jobs": [],
            }
        )
    env["torch"] = torch.__version__
    if not torch.cuda.is_available():
        emit(
            {
                "status": "skipped",
                "reason": f"no CUDA GPU for {sys.executable} (torch {torch.__version__})",
                "env": env,
                "jobs": [],
            }
        )
    env["gpu"] = torch.cuda.get_device_name(0)
    env["capability"] = list(torch.cuda.get_device_capability(0))
    if importlib.util.find_spec("vllm") is None:
        emit(
            {
                "status": "skipped",
                "reason": f"vllm is not installed for {sys.executable}",
                "env": env,
                "jobs": [],
            }
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # The level judges the file itself: mm3-codemod's own vLLM plugin, where installed, stays out.
    os.environ.setdefault("MM3_CODEMOD_PLUGIN", "off")
    os.environ.setdefault(
        "VLLM_DISABLE_COMPILE_CACHE", "1"
    )  # a file's code must never reuse another's graphs
    t = time.perf_counter()
    try:
        import vllm
        import vllm.models.minimax_m3.nvidia
        from transformers import AutoConfig
        from vllm.transformers_utils.configs.minimax_m3 import MiniMaxM3TextConfig
    except BaseException as exc:
        facts = exc_facts(exc, "vllm")
        emit(
            {
                "status": "skipped",
                "reason": f"vLLM cannot be imported here: {facts['exc_type']}: {facts['message']}",
                "env": env,
                "jobs": [],
                "traceback": facts["traceback"][-8:],
            }
        )
    env["vllm"] = getattr(vllm, "__version__", "?")
    env["import_seconds"] = round(time.perf_counter() - t, 1)
    # vLLM registers the VL and MTP configs; the text backbone's model_type is made known here
    AutoConfig.register("minimax_m3_text", MiniMaxM3TextConfig, exist_ok=True)
    notes = env.setdefault("notes", [])
    if os.environ.get("MM3_ENGINE_NORM_FALLBACK") == "1":
        notes.append(install_norm_fallback("MM3_ENGINE_NORM_FALLBACK=1"))
    else:
        why = probe_flashinfer_norm()
        if why:
            notes.append(install_norm_fallback(why))
    work = spec["workdir"] or tempfile.mkdtemp(prefix="mm3-engine-")
    cfg = tiny_config(spec["config"], spec["vocab"])
    ckpt = os.path.join(work, "tiny-minimax-m3")
    try:
        write_checkpoint(ckpt, cfg, spec["std"], spec["seed"])
    except BaseException as exc:
        facts = exc_facts(exc, "checkpoint")
        emit(
            {
                "status": "skipped",
                "reason": f"the tiny checkpoint could not be written: {facts['message']}",
                "env": env,
                "jobs": [],
            }
        )
    env["config"] = {
        k: cfg[k]
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "num_local_experts",
            "vocab_size",
        )
    }
    batch = prompts(spec["prompt_lengths"], spec["vocab"], spec["seed"])
    jobs = []
    for job in spec["jobs"]:
        if spec["deadline"] and time.time() > spec["deadline"]:
            jobs.append(
                {
                    "label": job["label"],
                    "status": "not-run",
                    "phase": "deadline",
                    "seconds": 0.0,
                    "message": "the time budget was spent before this run",
                    "frames": [],
                    "traceback": [],
                }
            )
            continue
        jobs.append(run_job(job, spec, ckpt, batch))
        print(
            f"[mm3-engine] {job['label']}: {jobs[-1].get('status')} in {jobs[-1].get('seconds')} s",
            flush=True,
        )
    emit({"status": "ok", "reason": "", "env": env, "jobs": jobs, "prompt_lengths": spec["prompt_lengths"]})


def probe_flashinfer_norm() -> str | None:
    """None when flashinfer's Gemma RMSNorm (which MiniMax-M3's norm calls) runs here."""
    import torch

    try:
        from flashinfer.norm import gemma_rmsnorm

        x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
        gemma_rmsnorm(x, torch.zeros(512, device="cuda", dtype=torch.bfloat16), 1e-6)
        torch.cuda.synchronize()
        return None
    except BaseException as exc:
        return f"flashinfer.norm unusable here ({type(exc).__name__}: {str(exc)[:200]})"


def install_norm_fallback(why: str) -> str:
    """Plain-PyTorch Gemma RMSNorm in flashinfer.norm's place (both cache runs use it alike)."""
    import types

    import torch

    def gemma_rmsnorm(x, weight, eps=1e-6, out=None, enable_pdl=None):
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
        if out is not None:
            out.copy_(y)
            return out
        return y

    def gemma_fused_add_rmsnorm(x, residual, weight, eps=1e-6, enable_pdl=None):
        residual.add_(x)
        x.copy_(gemma_rmsnorm(residual, weight, eps))

    mod = types.ModuleType("flashinfer.norm")
    mod.gemma_rmsnorm, mod.gemma_fused_add_rmsnorm = gemma_rmsnorm, gemma_fused_add_rmsnorm
    sys.modules["flashinfer.norm"] = mod
    try:
        import flashinfer

        flashinfer.norm = mod
    except BaseException:
        pkg = types.ModuleType("flashinfer")
        pkg.__path__ = []
        pkg.norm = mod
        sys.modules["flashinfer"] = pkg
    return f"Gemma RMSNorm in plain PyTorch: {why}"


if __name__ == "__main__":
    main()
