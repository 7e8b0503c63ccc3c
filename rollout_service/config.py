"""Configuration of the rollout service (`RolloutConfig`), validated when loaded.

Loaded from YAML with `sinkflex.config.load_config(path, RolloutConfig)` or built from the
command line of `python -m rollout_service`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from sinkflex.config import StrictModel
from sinkflex.tls import TLSConfig


class EngineConfig(StrictModel):
    """The vLLM engine."""

    model: str
    """A transformers-format folder (e.g. `sinkflex-rl models prepare smollm2`)."""

    dtype: str = "auto"
    """Engine dtype. auto: bfloat16 on a CPU where bf16 is measured fast (sinkflex.hardware), the
    rule of the learner's model.dtype auto; float32 on other CPUs; vLLM's auto on CUDA. float32 keeps engine
    log-probs closest to an fp32 learner (see docs/bench_learner.md for the mismatch)."""

    max_model_len: int = Field(8192, ge=256)
    """Context length of the engine in tokens."""

    kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache memory in GiB (on CPU vLLM otherwise reserves a fraction of all RAM)."""

    enforce_eager: bool = True
    """No graph capture (faster start on CPU)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """vLLM tensor parallel size (GPUs of the engine; the local launcher sets it from
    local.engine_gpus)."""

    gpu_memory_utilization: Optional[float] = Field(None, gt=0, lt=1)
    """vLLM's gpu_memory_utilization on CUDA (None: vLLM's default); the local launcher sets it
    when the engine shares its GPUs with the learner (local.share_gpus)."""

    policy_version: int = Field(0, ge=0)
    """Policy version of the weights in `model`."""

    seed: int = Field(0, ge=0, le=2**32 - 1)
    """The engine's seed, in 0 … 2**32 − 1 (vLLM seeds numpy with it, which takes no other)."""


class AgentConfig(StrictModel):
    """The agent loop's budgets and format."""

    tool_format: Literal["hermes", "qwen3", "llama3", "harmony"] = "hermes"
    """The policy's model family (rollout_service.formatting, docs/models.md): hermes (Hermes/ChatML
    `<tool_call>`, SmolLM2), qwen3 (Qwen3's hybrid-thinking template), llama3 (Llama 3.x bare-JSON
    tool calls) or harmony (gpt-oss). Checked at start-up on a tool round trip of the policy's template."""

    enable_thinking: bool = True
    """qwen3: the template's `enable_thinking` (False: the prompt closes an empty reasoning block).
    The reasoning stays in the token stream (loss mask 1) and is never sent to the environment."""

    reasoning_effort: Literal["low", "medium", "high"] = "low"
    """harmony (gpt-oss): the reasoning effort of the system message."""

    max_turns: int = Field(8, ge=1)
    """Agent turns per episode (TERMINATION_REASON_MAX_TURNS beyond)."""

    max_context_tokens: int = Field(8192, ge=64)
    """Tokens per trajectory (TERMINATION_REASON_MAX_CONTEXT_TOKENS when no room is left)."""

    max_new_tokens: int = Field(256, ge=1)
    """Generated tokens per turn when the request does not say."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = 0

    max_groups_in_flight: int = Field(8, ge=1)
    """Groups (tasks) rolled out concurrently; each runs its G samples concurrently."""

    env_max_steps: int = Field(0, ge=0)
    """Step budget passed to env Reset (0: the env server's default)."""

    def format_options(self) -> dict:
        """The family's options for `rollout_service.formatting.formatter_factory`."""
        return {"enable_thinking": self.enable_thinking, "reasoning_effort": self.reasoning_effort}


class EnvRoute(StrictModel):
    """How the rollout treats one env: where its training reward comes from, and what a reply
    without tool calls means."""

    reward: Literal["service", "env"] = "service"
    """service: a RewardService (reward.v1; τ²-Bench's checker in `reward_service`) scores every
    finished episode and its breakdown becomes the trajectory's; an env or task it does not know
    (NOT_FOUND) fails the Rollout request before anything is sampled, never a silent 0.
    env: the env's own reward, Gymnasium semantics: the episode's return, the sum of its
    StepResponse.rewards (the contract gives 0 before the end, so: the reward of the step that
    ended it, and 0 for an episode the env did not end — max_turns, context, an empty reply),
    with the env's breakdown when the terminating step's info holds one (`reward_breakdown`, a
    common.v1.RewardBreakdown in protobuf JSON). Never overwritten by a reward service."""

    reward_address: Optional[str] = None
    """reward: service only: the RewardService at this address ("host:port", anyone's reward.v1)
    scores this env; None: the service's `reward_address` (or the in-process τ²-Bench one)."""

    text_ends_episode: bool = False
    """A reply with text and no tool call (parsed without error) ends the episode: it is sent
    with StepRequest.stop (agent stop), so the env answers with its terminating step. For envs
    without a user to talk to (examples/bookshop, examples/clinic). False: the text is a reply to
    the user (the contract's reading; τ²-Bench). Text holding τ²-Bench's `###STOP###` is sent
    with stop either way."""

    @model_validator(mode="after")
    def _address_needs_service(self) -> "EnvRoute":
        if self.reward_address and self.reward != "service":
            raise ValueError("reward_address is set, but reward is 'env' (the env's own reward needs no reward service)")
        return self


class RolloutLimits(StrictModel):
    """Server-side caps on one Rollout request (INVALID_ARGUMENT naming the cap when exceeded)."""

    max_group_size: int = Field(64, ge=1)
    """Largest RolloutRequest.group_size (rollouts per task)."""
    max_tasks_per_call: int = Field(256, ge=1)
    """Most task ids in one RolloutRequest."""
    max_turns: int = Field(64, ge=1)
    """Largest RolloutRequest.max_turns (0 in the request: agent.max_turns)."""
    max_context_tokens: int = Field(131072, ge=64)
    """Largest RolloutRequest.max_context_tokens (0 in the request: agent.max_context_tokens), and
    largest sampling.max_new_tokens."""
    max_temperature: float = Field(10.0, gt=0)
    """Largest sampling.temperature (the request's must also be finite; 0: the default)."""


class RolloutConfig(StrictModel):
    """The rollout service."""

    engine: EngineConfig
    agent: AgentConfig = AgentConfig()

    env_address: Optional[str] = None
    """gRPC address of the env service; None: an in-process env (LocalEnvClient)."""

    reward_address: Optional[str] = None
    """gRPC address of the reward service; None: an in-process one (LocalRewardClient)."""

    envs: dict[str, EnvRoute] = {}
    """Per env name: where its reward comes from and how its episodes end (`EnvRoute`). An env
    not listed gets the defaults: scored by the reward service (τ²-Bench domains keep τ²-Bench's
    checker), text replies go to the user."""

    tls: TLSConfig = Field(
        default_factory=TLSConfig,
        description="TLS / mutual TLS of the gRPC server, and of this service's clients (sinkflex.tls; default: plaintext).",
    )

    limits: RolloutLimits = RolloutLimits()

    policy_root: Optional[str] = None
    """Folder the learner publishes policy versions into (<learner run_dir>/policy): UpdateWeights
    loads only <policy_root>/v<N> for policy version N (a complete, published version). None:
    any folder of safetensors (a warning at start); the launcher, compose and the chart set it."""

    def route(self, env: str) -> EnvRoute:
        """The settings of `env` (the defaults when it is not listed in `envs`)."""
        return self.envs.get(env) or EnvRoute()

    redis_url: Optional[str] = None
    """Trajectory buffer; None: REDIS_URL, else the embedded Redis."""

    weight_updates: Literal["between_requests", "between_turns"] = "between_requests"
    """Where an UpdateWeights may land in a Rollout request with publish=true (training data).
    between_requests: never inside one — the update waits until every running request has
    finished, and a request that arrives meanwhile waits for the update — so every turn of every
    episode of a request is sampled by ONE policy version (synchronous, on-policy training:
    the experiment's rollout.max_staleness 0). between_turns: the update lands between two
    generations (asynchronous training, rollout.max_staleness >= 1); an episode may then span two
    versions and its TurnInfo.policy_version says which turn had which. Requests with
    publish=false (validation) are always pinned to one version."""

    user_sim_port: Optional[int] = Field(None, ge=0, le=65535)
    """Serve the OpenAI-compatible user-simulator endpoint on this port, backed by the
    policy engine (None: do not serve; 0: any free port)."""

    user_sim_max_tokens: int = Field(256, ge=1)
    """Cap on tokens of one user-simulator reply."""
