"""The learner's memory model (learner_service/memory_model.py) against a real CPU run of the same
step: on a small gpt-oss-shaped model the peak traced with fake tensors equals, within 2 %, the
peak of the same learner step run with real tensors (same tracker, one rank over gloo). Eager
attention, because it is the one path that runs identically in both (the flex sink path has no
CPU backward; the fake trace routes it through the flex op)."""

from __future__ import annotations

import json

import pytest

from learner_service.memory_model import (
    GPT_OSS_20B,
    analytic_peak,
    learner_config,
    trace_step,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")

#: gpt-oss-20b's structure (sinks, GQA, alternating sliding / full layers, experts top-4, yarn
#: RoPE), at toy widths.
SMALL = dict(GPT_OSS_20B, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
             layer_types=["sliding_attention", "full_attention"], num_attention_heads=8, num_key_value_heads=2,
             head_dim=16, num_local_experts=8, vocab_size=1024, sliding_window=16)
TOKENS = 512
#: fake vs real peak: the same storages are allocated; only values differ
TOLERANCE = 0.02


@pytest.fixture(scope="module")
def eager_step():
    """(fake trace, real run) of the same learner step with eager attention."""
    cfg = learner_config(SMALL, TOKENS, "eager")
    return trace_step(cfg, TOKENS, gpus=1, fake=True), trace_step(cfg, TOKENS, gpus=1, fake=False)


def test_fake_trace_matches_a_real_cpu_run_of_the_same_step(eager_step):
    predicted, real = eager_step
    assert real.assumed == {}  # real values everywhere
    assert real.parts["optimizer_state"] > 0  # the moments of a previous step are there
    assert predicted.peak_bytes == pytest.approx(real.peak_bytes, rel=TOLERANCE), (predicted, real)
    assert sum(predicted.parts.values()) == predicted.peak_bytes
    for part in ("parameters", "gradients", "optimizer_state", "attention"):
        assert predicted.parts[part] == pytest.approx(real.parts[part], rel=TOLERANCE, abs=4096), part
    # only scalar reads and nonzero/boolean indexing of large unknown tensors are assumed
    assert set(predicted.assumed) <= {"_local_scalar_dense", "nonzero", "index"}


def test_sink_path_traced_through_flex_is_smaller_than_eager_at_long_context(eager_step):
    eager, _ = eager_step
    ours = trace_step(learner_config(SMALL, TOKENS, "sinkflex"), TOKENS, gpus=1)
    # eager keeps [Hq, N, N + 1] scores; the flex op's fake allocates out and LSE only
    assert eager.parts["attention"] > 8 * 2 * TOKENS * TOKENS  # at least the bf16 scores of all 8 heads
    assert ours.parts["attention"] < eager.parts["attention"] / 10
    assert ours.peak_bytes < eager.peak_bytes
    # the analytic count says the same
    assert analytic_peak(SMALL, TOKENS, 1, "sinkflex")[1]["attention"] < analytic_peak(SMALL, TOKENS, 1, "eager")[1]["attention"] / 10


def test_memory_command_on_a_model_config(tmp_path):
    from typer.testing import CliRunner

    from sinkflex_rl.cli import app

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(app, ["memory", "-m", str(tmp_path), "-n", "64", "-a", "sinkflex", "-g", "2",
                                      "--gpu-gb", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["attention"], r["seq_len"], r["gpus"]) for r in rows] == [("sinkflex", 64, 2)]
    assert rows[0]["predicted_peak_gb"] > 0 and rows[0]["analytic_peak_gb"] > 0
    assert "fits" in result.output
    bad = CliRunner().invoke(app, ["memory", "-m", "no-such-model", "--no-trace"])
    assert bad.exit_code == 2 and "unknown model" in bad.output


def test_memory_command_reads_the_experiments_learner_service_section_and_refuses_bad_input(tmp_path):
    """Found by feeding `sinkflex-rl memory` bad input: `-c` read the experiment's old `learner`
    section, so the `learner_service` section (what configs/gpt-oss-20b.yaml and every experiment
    write) was ignored without a word, and a bad one was never checked; `-g 0` planned for 1 GPU;
    `--gpu-gb -1` / `nan` said DOES NOT FIT; an unwritable `--json` was a traceback after the plan;
    a config.json that is not JSON gave a JSON error without the file. Each is now exit 2, one
    line naming the flag, file or field."""
    from typer.testing import CliRunner

    from sinkflex_rl.cli import app

    def run(*args):
        result = CliRunner().invoke(app, ["memory", "--no-trace", "-n", "64", *args])
        assert "Traceback" not in result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        return result

    bad_section = tmp_path / "bad.yaml"
    bad_section.write_text("learner_service:\n  batch:\n    micro_batch_size: 0\n")
    result = run("-c", str(bad_section))
    assert result.exit_code == 2 and "learner_service.batch.micro_batch_size" in result.output, result.output
    old = tmp_path / "old.yaml"
    old.write_text("learner:\n  grpo: {beta: 0.1}\n")
    result = run("-c", str(old))
    assert result.exit_code == 2 and "'learner' is now 'learner_service'" in result.output, result.output
    procs = tmp_path / "procs.yaml"
    procs.write_text("local:\n  learner_procs: 3\n")
    result = run("-c", str(procs))  # local.learner_procs is the default --gpus
    assert result.exit_code == 0 and result.output.splitlines()[1].split()[2] == "3", result.output
    for args, words in [(["-g", "0"], "--gpus >= 1"), (["--gpu-gb", "-1"], "--gpu-gb"), (["--gpu-gb", "nan"], "--gpu-gb"),
                        (["--json", str(tmp_path)], "--json"), (["--json", str(tmp_path / "no" / "x.json")], "--json")]:
        result = run(*args)
        assert result.exit_code == 2 and words in result.output, (args, result.output)
    not_json = tmp_path / "config.json"
    not_json.write_text("not json")
    result = run("-m", str(not_json))
    assert result.exit_code == 2 and str(not_json) in result.output, result.output
