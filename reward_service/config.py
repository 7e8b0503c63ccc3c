"""Typed configuration of the reward service (`python -m reward_service`).

One `RewardServiceConfig` per process, validated when loaded (`sinkflex.config.load_config`
names a bad field by its dotted path). The NL-assertion judge is optional: without it,
a task whose reward basis contains NL_ASSERTION is refused with FAILED_PRECONDITION
instead of being guessed.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from sinkflex.config import StrictModel
from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES
from sinkflex.tls import TLSConfig

#: Default gRPC port and Prometheus port of the reward service (see the brief's port table).
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9092


class JudgeConfig(StrictModel):
    """The LLM that judges NL assertions (tau2 `NLAssertionsEvaluator`), at an OpenAI-compatible endpoint.

    The call goes through litellm exactly as tau2 makes it (`tau2.utils.llm_utils.generate`),
    with tau2's judge prompt; only the model, endpoint, key and sampling arguments come from here.
    """

    model: str = Field(description="Model name as the endpoint serves it (e.g. 'gpt-4o-mini', a vLLM served name).")
    base_url: str | None = Field(
        default=None,
        description="OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1). None: litellm's provider default.",
    )
    api_key: str | None = Field(default=None, description="API key; 'EMPTY' is sent to a base_url when unset.")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature (tau2's default: 0.0).")
    seed: int | None = Field(default=0, description="Sampling seed sent to the endpoint (None: not sent).")
    timeout_s: float = Field(default=120.0, gt=0, description="Timeout of one judge call, seconds.")
    num_retries: int = Field(default=2, ge=0, description="Retries of a failed judge call (litellm).")

    def litellm_model(self) -> str:
        """The model name as litellm wants it: `openai/<model>` when a base_url is set."""
        if self.base_url and not self.model.startswith("openai/"):
            return f"openai/{self.model}"
        return self.model

    def litellm_kwargs(self) -> dict:
        """Keyword arguments for `tau2.utils.llm_utils.generate` (passed on to `litellm.completion`)."""
        kwargs: dict = {"temperature": self.temperature, "timeout": self.timeout_s, "num_retries": self.num_retries}
        if self.seed is not None:
            kwargs["seed"] = self.seed
        if self.base_url:
            kwargs["api_base"] = self.base_url
            kwargs["api_key"] = self.api_key or "EMPTY"
        elif self.api_key:
            kwargs["api_key"] = self.api_key
        return kwargs


class RewardServiceConfig(StrictModel):
    """The reward service process."""

    host: str = Field(default="127.0.0.1", description="Address to bind.")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="gRPC port (0: any free port).")
    metrics_port: int | None = Field(
        default=DEFAULT_METRICS_PORT, ge=0, le=65535, description="Prometheus /metrics port (None: no metrics)."
    )
    max_message_bytes: int = Field(
        default=DEFAULT_MAX_MESSAGE_BYTES, gt=0, description="Limit on one gRPC message, both directions, bytes."
    )
    max_workers: int = Field(default=16, gt=0, description="gRPC handler threads.")
    max_batch_items: int = Field(256, ge=1, description="Most items in one ScoreBatch request "
                                 "(INVALID_ARGUMENT naming this cap above it).")
    grace_seconds: float = Field(default=10.0, ge=0, description="Graceful-shutdown grace period, seconds.")
    preload_envs: list[str] = Field(
        default_factory=lambda: ["retail"],
        description="tau2 domains whose tasks are loaded before health turns SERVING (others load on first use).",
    )
    judge: JudgeConfig | None = Field(default=None, description="NL-assertion judge; None: NL tasks are refused.")
    task_files: dict[str, list[str]] = Field(
        default_factory=dict,
        description=(
            "Extra task sets per env besides the tasks tau2 ships: env -> task dirs (or tasks JSON files) in "
            "tau2's layout (tasks.json + split_tasks.json, see docs/tasks.md), loaded through "
            "tau2_adapter.tasks.domain_tasks at start (a bad file fails the start), so their task ids are scorable."
        ),
    )

    tls: TLSConfig = Field(
        default_factory=TLSConfig,
        description="TLS / mutual TLS of the gRPC server, and of this service's clients (sinkflex.tls; default: plaintext).",
    )
    @field_validator("preload_envs")
    @classmethod
    def _no_empty_env(cls, v: list[str]) -> list[str]:
        if any(not e for e in v):
            raise ValueError("env names must not be empty")
        return v

    @field_validator("task_files")
    @classmethod
    def _no_empty_paths(cls, v: dict[str, list[str]]) -> dict[str, list[str]]:
        for env, files in v.items():
            if not env:
                raise ValueError("env names must not be empty")
            if any(not str(f).strip() for f in files):
                raise ValueError(f"{env}: empty path")
        return v
