"""Trim a device run's engine.json (bench/vllm024_engine.py) into the engine level's test data:
the runs of one configuration, their outputs with logprobs rounded to 4 digits (the prompt
tokens' logprobs left out: reported, never judged), each run's file path replaced by
``<file>`` (the test puts its own file there).

    python bench/engine_testdata.py OUT/engine.json tests/data/engine_h200_v024.json
"""

from __future__ import annotations

import json
import re
import sys

CONFIG = "graphs,bs128"
RUNS = ("rewritten:auto", "rewritten:fp8_e4m3", "native:fp8_e4m3", "fork-era:fp8_e4m3",
        "unwritten:fp8_e4m3", "shifted:fp8_e4m3", "padded:fp8_e4m3")
WORK_FILE = re.compile(r"/tmp/v24eng-[^/]+/[a-z_-]+_model\.py")


def rounded(values: list) -> list:
    return [None if v is None else round(v, 4) for v in values]


def trim(job: dict) -> dict:
    keep = {k: job[k] for k in ("status", "phase", "exc_type", "message", "capture", "seconds", "capacity") if k in job}
    if "frames" in job:
        keep["frames"] = [[WORK_FILE.sub("<file>", f), n] for f, n in job["frames"] if WORK_FILE.search(f)]
    if "traceback" in job:
        keep["traceback"] = job["traceback"][-3:]
    if job.get("outputs"):
        keep["outputs"] = [
            {k: rounded(o[k]) if k == "logprobs" else o[k] for k in o if k != "prompt_logprobs"}
            for o in job["outputs"]
        ]
    return keep


def main(src: str, dst: str) -> None:
    report = json.load(open(src))
    jobs = {j["label"]: j for r in report["results"].values() for j in r.get("jobs", [])}
    env = next((r["env"] for r in report["results"].values() if r.get("env")), None)
    runs = {run: trim(jobs[f"{run}@{CONFIG}"]) for run in RUNS if f"{run}@{CONFIG}" in jobs}
    out = {"source": f"bench/vllm024_engine.py on the device, {CONFIG}", "env": env, "runs": runs}
    with open(dst, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
