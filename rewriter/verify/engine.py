"""Level 4 (opt-in, ``verify --engine``): serve a tiny MiniMax-M3 built from the file.

The heavy part runs in a subprocess of the target interpreter
(:mod:`rewriter.verify.engine_child`, which needs only torch and vLLM there):
vLLM's offline engine (``vllm.LLM``, CUDA graphs on unless ``enforce_eager``,
block size 128 and the ``TRITON_ATTN`` backend by default) serves a 3-layer
random-weight model (normal, std 0.02, a safetensors checkpoint in a temp
folder; no tokenizer, nothing downloaded) whose model class comes from the
verified file, on one batch of 14 prompts of 5 to 1100 tokens (those over 512
prefilled in chunks; decode padded to a captured size), greedy, N new tokens with
logprobs, the prompts' top-1 tokens teacher-forced: once with
``kv_cache_dtype="auto"`` and once with ``"fp8_e4m3"``. Where the installed vLLM's
own ``nvidia/model.py`` passes a kv-cache dtype to the fused insert (``native``),
its fp8 run is served too and the bypass is judged against it as well. The two are
close, not identical: the native kernel rounds its float32 result to e4m3, the
bypass the bf16 value the op left in ``qkv`` (on the H200, 3.1 % of K bytes one
e4m3 step apart; docs/engine.md).

This module compares what the child reports - pure functions, testable on
recorded outputs - and makes the :class:`~rewriter.verify.levels.LevelResult`:

- **skipped**: no torch, no CUDA GPU, no vLLM, vLLM not importable, or the file
  defines no model class vLLM can serve (the fork-era example: layer classes only);
- **failed**: the engine raised in the file's code (with the file's line), the
  CUDA-graph capture failed, a run raised, or the fp8 run is garbage: its token
  prompt top-1 or greedy agreement with the bf16 run (or the native fp8 run) is
  below :data:`MIN_PROMPT_AGREEMENT` or :data:`MIN_AGREEMENT`;
- **passed**: both runs complete and agree at least that well.

Whatever the verdict, each run reports the KV cache its engine allocated (vLLM's own
block count x block size, :class:`Capacity`), and the level the fp8 run's tokens over
the bf16 run's at the same ``gpu_memory_utilization``: what the bypass is for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .levels import LevelResult, Status

CHILD = Path(__file__).with_name("engine_child.py")
TAIL = 8
DEFAULT_BLOCK_SIZE = 128  # the seed's --block-size
DEFAULT_BACKEND = "TRITON_ATTN"  # the seed's attention backend
DEFAULT_NEW_TOKENS = 16
FP8 = "fp8_e4m3"
# Garbage thresholds, measured with vLLM 0.24.0 on this tiny model (14 prompts, 4,141
# teacher-forced prompt positions, 16 greedy tokens each; graphs, block 128, TRITON_ATTN;
# the H100's outputs are bit-identical to the H200's; tests/data/engine_h100_v024.json):
#                                   prompt top-1 vs bf16   greedy vs bf16
#   native fp8 insert (noise floor)        0.882               0.482
#   the bypass                             0.882               0.451
#   cache never written                    0.013               0.000
#   cache written one slot off             0.814               0.268
# Random weights give near-flat logits: fp8's 3 mantissa bits flip a greedy token every
# ~12 steps, and a flip ends the comparable prefix, so the greedy limit is a coarse catch
# well under the floor. The prompt positions are compared one by one (one flip does not
# carry over): 0.85 sits between the floor and the one-slot-off cache. A bypass that
# writes padded tokens to a real slot does not show here (0.882); the semantic level
# checks every slot bit for bit.
MIN_AGREEMENT = 0.2
MIN_PROMPT_AGREEMENT = 0.85


# ---- comparison: pure functions on recorded outputs --------------------------------


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where the token sequences differ (a length
    difference counts at the shorter's end); None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def prefix_agreement(a: list[int], b: list[int]) -> float:
    """Share of the positions (of the longer sequence) before the first divergence.

    After a divergence the two runs continue from different contexts, so later
    matches say nothing about the cache: only the common prefix counts."""
    n = max(len(a), len(b))
    if n == 0:
        return 1.0
    d = first_divergence(a, b)
    return 1.0 if d is None else d / n


def _largest(values) -> float | None:
    """The largest of the values that are not None; None when there is none."""
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _max_abs_delta(xs: list[float | None], ys: list[float | None]) -> float | None:
    """Largest |x - y| over the positions both have a value for; None when there is none."""
    return _largest(abs(x - y) for x, y in zip(xs, ys) if x is not None and y is not None)


def max_logprob_delta(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """Largest |logprob_a - logprob_b| of the chosen token over the common prefix
    (same context, same token); None when no position can be compared."""
    d = first_divergence(a["tokens"], b["tokens"])
    upto = len(a["tokens"]) if d is None else d
    return _max_abs_delta(a.get("logprobs", [])[:upto], b.get("logprobs", [])[:upto])


def prompt_facts(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int, float | None]:
    """Teacher-forced positions (the prompt's): ``(top-1 agreed, compared, max |d logprob|
    of the prompt token)``. Both runs see the same context at every position, so unlike
    the greedy tokens, one flip does not carry over into the positions after it."""
    pairs = [(x, y) for x, y in zip(a.get("prompt_top1") or [], b.get("prompt_top1") or []) if None not in (x, y)]
    delta = _max_abs_delta(a.get("prompt_logprobs") or [], b.get("prompt_logprobs") or [])
    return sum(1 for x, y in pairs if x == y), len(pairs), delta


@dataclass
class SequenceComparison:
    agreement: float
    first_divergence: int | None
    max_dlogprob: float | None
    prompt_agreed: int = 0
    prompt_positions: int = 0
    prompt_max_dlogprob: float | None = None


@dataclass
class Comparison:
    a: str
    b: str
    sequences: list[SequenceComparison] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        """Mean prefix agreement over the sequences."""
        return sum(s.agreement for s in self.sequences) / len(self.sequences) if self.sequences else 0.0

    @property
    def identical(self) -> int:
        return sum(1 for s in self.sequences if s.first_divergence is None)

    @property
    def first_divergence(self) -> int | None:
        """The earliest divergence over the sequences."""
        found = [s.first_divergence for s in self.sequences if s.first_divergence is not None]
        return min(found) if found else None

    @property
    def max_dlogprob(self) -> float | None:
        return _largest(s.max_dlogprob for s in self.sequences)

    @property
    def prompt_positions(self) -> int:
        return sum(s.prompt_positions for s in self.sequences)

    @property
    def prompt_agreement(self) -> float | None:
        """Share of the teacher-forced prompt positions whose top-1 token agrees."""
        n = self.prompt_positions
        return sum(s.prompt_agreed for s in self.sequences) / n if n else None

    @property
    def prompt_max_dlogprob(self) -> float | None:
        return _largest(s.prompt_max_dlogprob for s in self.sequences)

    def garbage(self, prompt_threshold: float = MIN_PROMPT_AGREEMENT, threshold: float = MIN_AGREEMENT) -> bool:
        p = self.prompt_agreement
        return (p is not None and p < prompt_threshold) or self.agreement < threshold

    def summary(self) -> str:
        d, p = self.max_dlogprob, self.prompt_agreement
        return (
            f"{self.b} vs {self.a}: prompt top-1 agreement {'-' if p is None else f'{p:.3f}'}; "
            f"greedy: {self.identical}/{len(self.sequences)} sequences identical, "
            f"agreement {self.agreement:.2f}, first divergence "
            f"{'-' if self.first_divergence is None else self.first_divergence}, "
            f"max |d logprob| {'-' if d is None else f'{d:.3g}'}"
        )

    def to_json(self) -> dict[str, object]:
        p = self.prompt_agreement
        return {
            "a": self.a,
            "b": self.b,
            "agreement": round(self.agreement, 4),
            "identical": self.identical,
            "sequences": len(self.sequences),
            "first_divergence": self.first_divergence,
            "max_dlogprob": self.max_dlogprob,
            "prompt_agreement": None if p is None else round(p, 4),
            "prompt_positions": self.prompt_positions,
            "prompt_max_dlogprob": self.prompt_max_dlogprob,
            "per_sequence": [
                {
                    "agreement": round(s.agreement, 4),
                    "first_divergence": s.first_divergence,
                    "max_dlogprob": s.max_dlogprob,
                }
                for s in self.sequences
            ],
        }


def compare_outputs(a_label: str, a: list[dict], b_label: str, b: list[dict]) -> Comparison:
    """Compare two runs' outputs (one ``{"tokens", "logprobs"}`` per prompt, same order)."""
    if len(a) != len(b):
        raise ValueError(f"{a_label} has {len(a)} sequences, {b_label} {len(b)}")
    return Comparison(
        a_label,
        b_label,
        [
            SequenceComparison(
                prefix_agreement(x["tokens"], y["tokens"]),
                first_divergence(x["tokens"], y["tokens"]),
                max_logprob_delta(x, y),
                *prompt_facts(x, y),
            )
            for x, y in zip(a, b)
        ],
    )


# ---- capacity: what fp8 buys -------------------------------------------------------


@dataclass
class Capacity:
    """The KV cache one run's engine allocated: vLLM's own block count and block size, at
    the run's ``gpu_memory_utilization`` (the child's ``kv_capacity``)."""

    label: str
    blocks: int
    block_size: int
    gpu_memory_utilization: float | None = None
    vllm_tokens: int | None = None  # vLLM's group-aware kv_cache_size_tokens
    kv_bytes: int | None = None  # the KV-cache tensors' bytes

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def bytes_per_token(self) -> float | None:
        return self.kv_bytes / self.tokens if self.kv_bytes and self.tokens else None

    @classmethod
    def of(cls, job: dict[str, Any]) -> Capacity | None:
        """The run's capacity, or None where the child reported none (an older child, a run
        that raised before the engine was built, a vLLM without these numbers)."""
        cap = job.get("capacity") or {}
        blocks, size = cap.get("blocks"), cap.get("block_size")
        if not (isinstance(blocks, int) and isinstance(size, int) and blocks > 0 and size > 0):
            return None
        return cls(
            job.get("label", "?"),
            blocks,
            size,
            cap.get("gpu_memory_utilization"),
            cap.get("vllm_tokens"),
            cap.get("kv_bytes"),
        )

    def to_json(self) -> dict[str, object]:
        per = self.bytes_per_token
        return {
            "label": self.label,
            "blocks": self.blocks,
            "block_size": self.block_size,
            "tokens": self.tokens,
            "vllm_tokens": self.vllm_tokens,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "kv_bytes": self.kv_bytes,
            "bytes_per_token": None if per is None else round(per, 2),
        }


def capacity_ratio(base: Capacity | None, other: Capacity | None) -> float | None:
    """``other``'s tokens over ``base``'s; None unless both were allocated at the same
    ``gpu_memory_utilization`` (else the ratio says nothing about the cache dtype)."""
    if base is None or other is None or base.gpu_memory_utilization != other.gpu_memory_utilization:
        return None
    return other.tokens / base.tokens


def capacities(jobs: dict[str, dict[str, Any]]) -> dict[str, object] | None:
    """The runs' capacities and fp8 over bf16 (the file's fp8 run, and the native insert's
    where it ran); None when no run reported one."""
    caps = {label: Capacity.of(j) for label, j in jobs.items()}
    caps = {label: c for label, c in caps.items() if c is not None}
    if not caps:
        return None
    bf16 = caps.get("file:auto")
    ratio = capacity_ratio(bf16, caps.get(f"file:{FP8}"))
    native = capacity_ratio(bf16, caps.get(f"native:{FP8}"))
    return {
        "runs": {label: c.to_json() for label, c in caps.items()},
        "fp8_over_bf16": None if ratio is None else round(ratio, 4),
        "native_fp8_over_bf16": None if native is None else round(native, 4),
    }


def capacity_summary(jobs: dict[str, dict[str, Any]]) -> str | None:
    """One line: the bf16 and the fp8 run's KV-cache tokens (blocks x block size) and their
    ratio, at the shared gpu_memory_utilization; None without both runs' numbers."""
    bf16, fp8 = Capacity.of(jobs.get("file:auto", {})), Capacity.of(jobs.get(f"file:{FP8}", {}))
    ratio = capacity_ratio(bf16, fp8)
    if ratio is None:
        return None
    return (
        f"KV cache at gpu_memory_utilization {bf16.gpu_memory_utilization}: "
        f"bf16 {bf16.tokens:,} tokens ({bf16.blocks:,} blocks x {bf16.block_size}), "
        f"fp8 {fp8.tokens:,} tokens ({fp8.blocks:,} x {fp8.block_size}): {ratio:.2f}x"
    )


# ---- the jobs and the child ---------------------------------------------------------


@dataclass
class EngineOptions:
    block_size: int = DEFAULT_BLOCK_SIZE
    backend: str | None = DEFAULT_BACKEND
    enforce_eager: bool = False
    new_tokens: int = DEFAULT_NEW_TOKENS
    min_agreement: float = MIN_AGREEMENT
    min_prompt_agreement: float = MIN_PROMPT_AGREEMENT
    timeout: float = 900.0


def jobs_for(path: Path, original: Path | None, opts: EngineOptions) -> list[dict[str, object]]:
    """The child's runs: the file with a bf16 and an fp8 cache, and the installed
    vLLM's own (native) file with an fp8 cache where there is one."""
    common = {"block_size": opts.block_size, "backend": opts.backend, "enforce_eager": opts.enforce_eager}
    jobs = [
        {"label": "file:auto", "file": str(path), "kv_cache_dtype": "auto", **common},
        {"label": f"file:{FP8}", "file": str(path), "kv_cache_dtype": FP8, **common},
    ]
    if original is not None:
        jobs.append({"label": f"native:{FP8}", "file": str(original), "kv_cache_dtype": FP8, **common})
    return jobs


def run_child(spec: dict[str, object], python: str | None = None, timeout: float = 900.0) -> dict[str, Any]:
    """Run the child in the target interpreter; its one JSON line, or a skipped/failed answer."""
    from rewriter.targets import run_python

    exe = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="mm3-engine-") as work:
        spec = {**spec, "workdir": work}
        spec_file = Path(work, "spec.json")
        spec_file.write_text(json.dumps(spec), encoding="utf-8")
        try:
            proc = run_python([exe, str(CHILD), str(spec_file)], timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"status": "failed", "reason": f"{exe}: {exc}", "jobs": []}
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        out["status"]
        return out
    except (IndexError, json.JSONDecodeError, KeyError, TypeError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-TAIL:]
        return {
            "status": "failed",
            "reason": f"{exe} exited {proc.returncode} while serving the model (the engine process crashed)",
            "jobs": [],
            "traceback": tail,
        }


def run_jobs(
    jobs: list[dict[str, object]], common: dict[str, object], python: str | None, timeout: float
) -> dict[str, Any]:
    """Each job in an engine process of its own: vLLM 0.24 does not clean up after an ``LLM``
    for a second one in the same process (seen on an H200: every later one raised in init).
    A skipped or crashed child stops the rest; the jobs' results are merged."""
    merged: dict[str, Any] = {"status": "ok", "jobs": []}
    for job in jobs:
        res = run_child({**common, "jobs": [job]}, python, timeout)
        merged.setdefault("env", res.get("env"))
        if res.get("status") != "ok":
            return {**res, "jobs": merged["jobs"] + res.get("jobs", [])}
        merged["jobs"] += res.get("jobs", [])
    return merged


def _file_line(job: dict[str, Any], file: Path, sites: list[int]) -> str | None:
    """Where in the file the run raised: its last frame in the file, else (compiled or
    captured code has no Python frame of the file) the insert site when the message
    names the fused op or its dtype check."""
    real = os.path.realpath(file)
    own = [n for f, n in job.get("frames", []) if os.path.realpath(f) == real]
    if own:
        return f"{file.name}:{own[-1]}"
    text = " ".join([job.get("message", ""), *job.get("traceback", [])])
    if sites and ("qknorm_rope_kv_insert" in text or "kv_cache dtype must match" in text):
        return f"{file.name}:{sites[0]} (the fused insert call; the raise came through compiled code)"
    return None


def judge_job(job: dict[str, Any], file: Path, sites: list[int]) -> tuple[str, str]:
    """``(passed | failed | skipped, why)`` for one run of the child."""
    if job.get("status") == "ok":
        return "passed", f"{job['label']}: completed in {job.get('seconds', 0):.1f} s"
    if job.get("status") == "not-run":
        return "skipped", f"{job['label']}: not run: {job.get('message', '')}"
    error = f"{job.get('exc_type', '?')}: {job.get('message', '')}".rstrip(": ")
    phase = job.get("phase")
    if phase == "import":
        if job.get("exc_type") == "LookupError":
            return "skipped", f"{job['label']}: {job.get('message')}"
        from rewriter.apply import FileError, read_source

        from .importcheck import import_lines, judge

        try:
            imports = import_lines(read_source(file))
        except FileError:
            imports = frozenset()
        frames = [(f, n) for f, n in job.get("frames", [])]
        status, why = judge(
            job.get("exc_type", "?"), job.get("message", ""), frames, str(file), None, imports
        )
        return status, f"{job['label']}: loading the file: {why}"
    where = _file_line(job, file, sites)
    what = "CUDA-graph capture failed" if job.get("capture") else f"the engine raised ({phase})"
    at = f" at {where}" if where else ""
    return "failed", f"{job['label']}: {what}{at}: {error}"


@dataclass
class EngineResult:
    status: str  # passed / failed / skipped
    reason: str
    details: list[str]
    comparisons: list[Comparison]
    raw: dict[str, Any]

    def to_json(self) -> dict[str, object]:
        jobs = [
            {k: j.get(k) for k in ("label", "status", "phase", "exc_type", "message", "seconds", "capacity")}
            for j in self.raw.get("jobs", [])
        ]
        return {
            "status": self.status,
            "reason": self.reason,
            "env": self.raw.get("env"),
            "runs": jobs,
            "comparisons": [c.to_json() for c in self.comparisons],
            "capacity": capacities({j.get("label", "?"): j for j in self.raw.get("jobs", [])}),
        }


def _refused_alike(job: dict[str, Any], native: dict[str, Any] | None) -> bool:
    """The installed vLLM's own file raised the same error while the engine was built: the
    configuration is refused (a block size its backends lack, say), not the file."""
    return (
        native is not None
        and native.get("status") == job.get("status") == "raised"
        and native.get("phase") == job.get("phase") == "init"
        and (native.get("exc_type"), native.get("message")) == (job.get("exc_type"), job.get("message"))
    )


def judge_results(
    results: dict[str, Any],
    file: Path,
    sites: list[int] = (),
    min_agreement: float = MIN_AGREEMENT,
    min_prompt_agreement: float = MIN_PROMPT_AGREEMENT,
) -> EngineResult:
    """The level's verdict from the child's report (pure: tests feed recorded reports)."""
    if results.get("status") != "ok":
        status = "skipped" if results.get("status") == "skipped" else "failed"
        return EngineResult(
            status, results.get("reason", "?"), list(results.get("traceback", [])), [], results
        )
    jobs = {j["label"]: j for j in results.get("jobs", [])}
    base, fp8, native = "file:auto", f"file:{FP8}", f"native:{FP8}"
    details = [f"{label}: {j.get('status')} ({j.get('seconds', 0):.1f} s)" for label, j in jobs.items()]
    details += [f"note: {n}" for n in (results.get("env") or {}).get("notes", [])]
    failures, skips = [], []
    for label, job in jobs.items():
        status, why = judge_job(job, file, sites)
        if status == "failed" and label.startswith("native:"):
            details.append(f"the installed vLLM's own file failed too: {why}")
            continue
        if status == "failed" and _refused_alike(job, jobs.get(native)):
            status, why = "skipped", f"{why} (vLLM refuses this configuration for its own file too)"
        (failures if status == "failed" else skips if status == "skipped" else []).append(why)
        if status != "passed":
            details += [f"  {line}" for line in job.get("traceback", [])[-TAIL:]]
    comps: list[Comparison] = []

    def ok(label: str) -> bool:
        return jobs.get(label, {}).get("status") == "ok"

    limits = f"(limits: prompt top-1 agreement {min_prompt_agreement:.2f}, greedy agreement {min_agreement:.2f})"
    # the file's fp8 run against its bf16 run, and against the native insert's fp8 run
    for a, b, judged in ((base, fp8, True), (base, native, False), (native, fp8, True)):
        if ok(a) and ok(b):
            c = compare_outputs(a, jobs[a]["outputs"], b, jobs[b]["outputs"])
            comps.append(c)
            if judged and c.garbage(min_prompt_agreement, min_agreement):
                failures.append(f"garbage: {c.summary()} {limits}")
    details += [c.summary() for c in comps]
    capacity = capacity_summary(jobs)
    details += [capacity] if capacity else []
    native_ratio = (capacities(jobs) or {}).get("native_fp8_over_bf16")
    if native_ratio is not None:
        details.append(f"KV cache of the installed vLLM's own file with fp8: {native_ratio:.2f}x bf16's tokens")
    if failures:
        return EngineResult("failed", "; ".join(failures), details, comps, results)
    if skips:
        return EngineResult("skipped", "; ".join(skips), details, comps, results)
    what = "; ".join([c.summary() for c in comps] + ([capacity] if capacity else [])) or "no comparison"
    env = results.get("env") or {}
    return EngineResult(
        "passed", f"vllm {env.get('vllm', '?')} on {env.get('gpu', '?')}: {what}", details, comps, results
    )


def installed_original(path: Path, python: str | None) -> Path | None:
    """The installed vLLM's own nvidia/model.py, when it is another file whose insert is native."""
    from codemods.schema import SiteState
    from rewriter.apply import FileStatus, classify_file
    from rewriter.targets import (
        TargetError,
        nvidia_dir,
        vllm_install_of_interpreter,
        vllm_of_current_interpreter,
    )

    try:
        pkg = vllm_install_of_interpreter(python)[0] if python else vllm_of_current_interpreter()
        original = nvidia_dir(pkg, "installed vLLM") / "model.py"
    except TargetError:
        return None
    if not original.is_file() or os.path.realpath(original) == os.path.realpath(path):
        return None
    planned = classify_file(original)
    if planned.status is FileStatus.ERROR:
        return None
    return original if any(s.state is SiteState.NATIVE for s in planned.sites) else None


def engine_level(path: Path, sites: list[int], python: str | None = None, opts: EngineOptions | None = None):
    """The engine level's LevelResult for one file (and its JSON, in ``details``' owner)."""
    opts = opts or EngineOptions()
    original = installed_original(path, python)
    results = run_jobs(jobs_for(path, original, opts), {"new_tokens": opts.new_tokens}, python, opts.timeout)
    res = judge_results(results, path, sites, opts.min_agreement, opts.min_prompt_agreement)
    return LevelResult("engine", Status(res.status), res.reason, res.details), res
