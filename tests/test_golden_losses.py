"""Golden losses: the first seeded GRPO steps (and a warm-start step) of tiny models, as numbers
written once to tests/golden/learner_losses.json. Any refactor of the learner (data path,
packing, attention, loss) must reproduce them; a deliberate change of the arithmetic
regenerates the file with `SINKFLEX_UPDATE_GOLDEN=1 bin/test tests/test_golden_losses.py`
and says why in its commit.

Float32 on one thread, CPU: the same inputs give the same bits run to run; the tolerance
(rtol 1e-5) leaves room for a different but equivalent summation order only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fixtures.learner import TINY_GPT_OSS, TINY_LLAMA, learner_config, make_group

GOLDEN = Path(__file__).parent / "golden" / "learner_losses.json"
KEYS = ("loss", "pg_loss", "grad_norm", "clip_fraction", "ratio_mean", "entropy")


def _steps(arch: dict, tmp_path: Path) -> list[dict[str, float]]:
    from learner_service.trainer import Learner

    cfg = learner_config(tmp_path, arch=arch, batch={"groups_per_step": 2, "micro_batch_size": 4},
                         model={"gradient_checkpointing": False})
    learner = Learner(cfg, metrics=False)
    out = []
    for step in range(3):
        groups = [make_group(f"s{step}g{k}", [1.0, 0.0, 0.5, 0.0], seed=10 * step + k, prompt_len=6) for k in range(2)]
        m = learner.train_step(groups)
        out.append({k: round(float(m[k]), 7) for k in KEYS})
    return out


def _warm_start(tmp_path: Path) -> dict[str, float]:
    from learner_service.sft import warm_start
    from learner_service.trainer import Learner

    cfg = learner_config(tmp_path, arch=TINY_LLAMA, batch={"micro_batch_size": 2}, model={"gradient_checkpointing": False},
                         warm_start={"epochs": 2, "batch_size": 2, "lr": 1e-2})
    learner = Learner(cfg, metrics=False)
    m = warm_start(learner, [make_group(f"d{k}", [1.0], seed=100 + k, prompt_len=6) for k in range(4)])
    return {k: round(float(m[k]), 7) for k in ("warm_start_loss", "warm_start_token_accuracy")}


def test_first_seeded_losses_match_the_golden_file(tmp_path, torch_one_thread):
    got = {"llama": _steps(TINY_LLAMA, tmp_path / "llama"), "gpt_oss": _steps(TINY_GPT_OSS, tmp_path / "gpt_oss"),
           "warm_start_llama": _warm_start(tmp_path / "ws")}
    if os.environ.get("SINKFLEX_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert want.keys() == got.keys()
    for model in ("llama", "gpt_oss"):
        assert len(want[model]) == len(got[model]) == 3
        for s, (w, g) in enumerate(zip(want[model], got[model])):
            for k in KEYS:
                assert g[k] == pytest.approx(w[k], rel=1e-5, abs=1e-7), f"{model} step {s + 1} {k}: {g[k]} != golden {w[k]}"
    for k, v in want["warm_start_llama"].items():
        assert got["warm_start_llama"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    # the steps did something: non-zero losses and gradients on every step
    assert all(s["grad_norm"] > 0 for m in ("llama", "gpt_oss") for s in got[m])
