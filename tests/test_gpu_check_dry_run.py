"""benchmarks/gpu_check.py stays runnable while no GPU is lent: its CPU dry run (the blockwise
path in place of compiled flex, tiny sizes) goes through the correctness, shared-prefix and
learner parts and their checks (the learner's GRPO step over gloo, world size 1, both attentions), and writes the same JSON a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_every_part(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run-cpu",
                           "--out-dir", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all GPU checks passed" in proc.stdout
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["device"] == "cpu (dry run)" and record["failures"] == []
    assert set(record["seconds"]) == {"correctness", "shared_prefix", "learner"}
    runs = record["learner"]["runs"]
    assert set(runs) == {"sinkflex@256", "eager@256"} and all(r["status"] == "ok" and r["optimizer_steps"] == 2 for r in runs.values())
    for mask in ("sliding", "full"):
        shared = record["shared_prefix"][mask]
        # each suffix alone vs the packed shared row, float64: exact
        assert shared["alone_vs_shared_max_abs_fp64"] < 1e-10
        for grad in ("out", "dq", "dk", "dv", "dsinks"):
            # the path under test is no further from float64 than eager attention in bf16
            assert shared[grad]["flex"] <= shared[grad]["eager_bf16"]
