"""benchmarks/bench_learner.py rewrites only its generated block of docs/bench_learner.md and
keeps the --mismatch run's figures in the JSON (a full run used to drop both)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_learner", REPO / "benchmarks" / "bench_learner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_block_replaced_and_hand_written_sections_kept(tmp_path):
    bench = _bench()
    page = tmp_path / "bench.md"
    page.write_text(f"# Learner benchmark\n\nintro\n\n{bench.BEGIN}\n## old table\n{bench.END}\n\n### Reading\n\nkept\n")
    bench.write_results(page, "## new table\n| a |\n")
    text = page.read_text()
    assert "## old table" not in text
    assert text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    assert text.index("intro") < text.index("## new table") < text.index("### Reading")
    assert text.endswith("### Reading\n\nkept\n")


def test_page_without_markers_gets_the_block_appended(tmp_path):
    bench = _bench()
    page = tmp_path / "new.md"
    bench.write_results(page, "## table\n")
    assert page.read_text() == f"# Learner benchmark\n\n{bench.BEGIN}\n## table\n{bench.END}\n"
    bench.write_results(page, "## table 2\n")
    assert page.read_text() == f"# Learner benchmark\n\n{bench.BEGIN}\n## table 2\n{bench.END}\n"


def test_committed_page_has_one_generated_block():
    bench = _bench()
    text = (REPO / "docs" / "bench_learner.md").read_text()
    assert text.count(bench.BEGIN) == 1 and text.count(bench.END) == 1
    assert text.index(bench.BEGIN) < text.index(bench.END)


def test_throughput_record_keeps_the_mismatch_figures(tmp_path):
    import json

    bench = _bench()
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": [1], "ratios": {"a": 1.0}, "logprob_mismatch": [{"mean": 0.1}],
                                "logprob_mismatch_meta": {"date": "d"}}))
    bench.write_record(path, {"rows": [2], "ratios": {"a": 2.0}})
    assert json.loads(path.read_text()) == {"rows": [2], "ratios": {"a": 2.0}, "logprob_mismatch": [{"mean": 0.1}],
                                            "logprob_mismatch_meta": {"date": "d"}}


def test_step_time_shows_each_round_when_there_are_several():
    bench = _bench()
    assert bench.step_s({"step_s": 97.5, "step_s_rounds": [95.1, 99.9]}) == "97.5 (95.1, 99.9)"
    assert bench.step_s({"step_s": 97.5, "step_s_rounds": [97.5]}) == "97.5"
    assert bench.step_s({"step_s": 3.0}) == "3.0"  # rows recorded before rounds were kept


def test_warmup_rounds_are_recorded_but_not_counted():
    import pytest

    bench = _bench()
    row = {"model": "m", "workload": "retail", "mode": "unshared_fp32", "effective_tokens": 11200,
           "step_s": 116.0, "tokens_per_s": 96.5, "step_s_rounds": [141.2, 90.8]}
    out = bench.summarise(row, 1)
    assert out["step_s"] == 90.8 and out["tokens_per_s"] == 11200 / 90.8
    assert out["step_s_rounds"] == [141.2, 90.8] and out["warmup_rounds"] == 1 and out["timed_rounds"] == 1
    assert bench.summarise(row, 0)["step_s"] == (141.2 + 90.8) / 2
    assert bench.summarise({"model": "m", "error": "worker exit 1"}, 1) == {"model": "m", "error": "worker exit 1"}
    with pytest.raises(SystemExit, match="leaves no timed round"):
        bench.summarise(row, 2)
