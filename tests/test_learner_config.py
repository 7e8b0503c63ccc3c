"""Learner config: validation names the bad field; command-line flags override the file."""

import pytest

from learner_service.__main__ import config_from_args, parse_args
from learner_service.config import load_learner_config
from sinkflex.config import ConfigError


def test_bad_fields_are_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {arch: {model_type: llama}}\ngrpo: {temperature: 0, clip_eps_low: 1.5}\n")
    with pytest.raises(ConfigError) as err:
        load_learner_config(p)
    assert "grpo.temperature" in str(err.value) and "grpo.clip_eps_low" in str(err.value)
    p.write_text("model: {path: /x, arch: {model_type: llama}}\n")
    with pytest.raises(ConfigError, match="exactly one of model.path and model.arch"):
        load_learner_config(p)
    p.write_text("model: {path: /x}\nbatch: {micro_batch: 2}\n")
    with pytest.raises(ConfigError, match="batch.micro_batch"):
        load_learner_config(p)


def test_flags_override_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {arch: {model_type: llama}}\ngrpo: {temperature: 0.7}\n")
    cfg = config_from_args(parse_args(["--config", str(p), "--model", "/models/m", "--redis-url", "redis://h:1/0",
                                       "--rollout-address", "r:50053", "--run-dir", "/tmp/r"]))
    assert cfg.model.path == "/models/m" and cfg.model.arch is None and cfg.grpo.temperature == 0.7
    assert cfg.buffer.url == "redis://h:1/0" and cfg.rollout_address == "r:50053" and cfg.run_dir == "/tmp/r"
    cfg = config_from_args(parse_args(["--model", "/models/m", "--redis-url", "redis://h:1/0"]))
    assert cfg.model.path == "/models/m" and cfg.buffer.url == "redis://h:1/0" and cfg.model.attn_implementation == "sinkflex"


def test_example_config_loads():
    from pathlib import Path

    cfg = load_learner_config(Path(__file__).resolve().parents[1] / "learner_service" / "example_cpu.yaml")
    assert cfg.model.path.endswith(".cache/sinkflex/models/smollm2") and "~" not in cfg.model.path
    assert cfg.grpo.clip_eps_high == 0.28 and cfg.model.attn_implementation == "sinkflex"
