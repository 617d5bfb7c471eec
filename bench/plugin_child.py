"""One vLLM start for bench/plugin_engine.py: ``python plugin_child.py SPEC.json``.

The offline engine (``vllm.LLM``) on the tiny checkpoint, with the mm3-codemod plugin as
installed (its mode from the spec's ``env``), the model module imported by vLLM itself - so
the plugin sees the import as in a server. Prints one JSON line: the job's facts
(``rewriter.verify.engine_child.run_job``) and the seconds from this process's start."""

import json
import os
import sys
import time


def main() -> None:
    T0 = time.time()
    spec = json.load(open(sys.argv[1]))
    os.environ.update(spec.get("env", {}))
    report, sys.stdout = sys.stdout, sys.stderr  # vLLM logs to stdout: keep it off the report line

    from transformers import AutoConfig
    from vllm.transformers_utils.configs.minimax_m3 import MiniMaxM3TextConfig

    from rewriter.verify import engine_child as ec

    AutoConfig.register("minimax_m3_text", MiniMaxM3TextConfig, exist_ok=True)
    why = ec.probe_flashinfer_norm()
    notes = [ec.install_norm_fallback(why)] if why else []
    full = {**ec.DEFAULTS, **spec}
    batch = ec.prompts(full["prompt_lengths"], full["vocab"], full["seed"])
    res = ec.run_job(spec["job"], full, spec["ckpt"], batch)
    res["since_process_start"] = round(time.time() - T0, 2)
    res["notes"] = res.get("notes", []) + notes
    print(json.dumps(res), file=report)
    report.flush()
    os._exit(0)


if __name__ == "__main__":  # vLLM spawns its engine core, which imports this module again
    main()
