"""The learner's typed configuration (one pydantic model per component, validated on load).

Load a YAML file with `load_learner_config(path)`; a bad or unknown field raises
`sinkflex.config.ConfigError` naming it by its dotted path (e.g. ``grpo.temperature``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import os

from pydantic import Field, field_validator, model_validator

from sinkflex.config import StrictModel, load_config
from sinkflex.tls import TLSConfig


class ModelConfig(StrictModel):
    """Which causal LM to train and how to run it."""

    path: str | None = None
    """A transformers model folder (safetensors + config.json), e.g. the prepared SmolLM2."""
    arch: dict[str, Any] | None = None
    """Instead of `path`: a transformers config as a dict (with `model_type`, e.g. "gpt_oss"),
    randomly initialised from `seed` (tiny test models, gpt-oss-shaped GPU benchmarks)."""
    attn_implementation: str = "sinkflex"
    """transformers attention implementation: "sinkflex" (the sink path, sinkflex.attention),
    or any built-in one ("eager", "sdpa")."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Parameter and compute dtype. auto: bfloat16 weights on CUDA; on a CPU where bfloat16 is
    measured fast (sinkflex.hardware.bf16_verdict) float32 weights (the master copy AdamW
    updates) under bfloat16 autocast; float32 elsewhere (learner_service.model.resolve_precision, logged). float64:
    exactness tests. Log-softmax, LSE and the GRPO ratio are float32 whatever the dtype."""
    gradient_checkpointing: bool = True
    """Recompute each decoder layer's activations in the backward pass."""
    seed: int = 0
    """Seed of the random initialisation (`arch`) and of the learner's shuffling."""

    @field_validator("path")
    @classmethod
    def _expand(cls, v: str | None) -> str | None:
        return os.path.expanduser(v) if v else v

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.path is None) == (self.arch is None):
            raise ValueError("set exactly one of model.path and model.arch")
        if self.arch is not None and "model_type" not in self.arch:
            raise ValueError("model.arch needs a model_type (e.g. gpt_oss, llama)")
        return self


class RewardShapingConfig(StrictModel):
    """Optional partial credit from τ²-Bench's own checks (learner_service/shaping.py); off when alpha = 0."""

    alpha: float = Field(0.0, ge=0)
    """α in R_train = R_task + α · partial; 0: train on τ²-Bench's reward alone (the default)."""
    action: float = Field(0.5, ge=0)
    """Weight of the share of golden actions matched."""
    env_assertion: float = Field(0.35, ge=0)
    """Weight of the share of environment assertions met."""
    communicate: float = Field(0.15, ge=0)
    """Weight of the share of communicate checks met."""


class GRPOConfig(StrictModel):
    """The algorithm: paper eqs. (3)–(7)."""

    adv_eps: float = Field(1e-6, ge=0)
    """ε_A in Â = (R − mean)/(std + ε_A)."""
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    """ε_c: the ratio is clipped below at 1 − ε_c."""
    clip_eps_high: float | None = Field(None, ge=0)
    """Upper clip 1 + ε_high ("clip-higher"); None: symmetric, = clip_eps_low."""
    beta: float = Field(0.0, ge=0)
    """Weight of the k3 KL to the reference policy π_ref: the policy RL starts from (the warm
    start's when there is one, else the initial model); 0: no reference model is loaded."""
    temperature: float = Field(1.0, gt=0)
    """The rollout engine's sampling temperature: log-probs are log softmax(logits / temperature)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """The rollout engine's top-p: log-probs over the same kept set as vLLM's (learner_service.logprobs)."""
    top_k: int = Field(0, ge=0)
    """The rollout engine's top-k (0: none): log-probs over the same kept set as vLLM's."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch of groups."""
    mini_batches: int = Field(1, ge=1)
    """Optimiser steps per epoch: the step's groups are shuffled and split into this many
    mini-batches of whole groups (a group is never split, so its shared prefix is computed
    once per mini-batch; with fewer groups than mini-batches the extra ones are empty)."""
    old_logprobs: Literal["engine", "recompute"] = "engine"
    """π_θold: the engine's sampled log-probs, or recomputed by the learner before the update."""
    filter_zero_variance: bool = False
    """Drop groups whose advantages are all 0 (equal rewards, a single valid rollout); logged.
    Changes the normaliser N (DAPO's dynamic sampling); `skip_zero_advantage` does not."""
    skip_zero_advantage: bool = True
    """Do not run rollouts whose advantage is exactly 0 through the training forward/backward
    when beta = 0: their clipped term min(ρ·0, clip(ρ)·0) is 0 whatever ρ, so their loss and
    gradient are exactly 0, and their tokens still count in the normaliser N = Σ_i T_i. Loss,
    gradients, weights and the loss / clip-fraction metrics are those of the full step; ratio_mean,
    entropy and the log-prob mismatch are then over the rollouts run (metrics skipped_rollouts,
    skipped_tokens). Ignored when beta > 0 (the KL term has a gradient at every token)."""
    reward_shaping: RewardShapingConfig = RewardShapingConfig()
    """Partial credit added to the training reward (validation never sees it)."""


class OptimConfig(StrictModel):
    """AdamW and the learning-rate schedule (transformers.get_scheduler)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"each of AdamW's betas must be in [0, 1), got {list(v)}")
        return v

    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (β1, β2), each in [0, 1) (torch.optim.AdamW)."""
    eps: float = Field(1e-8, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm; None: no clipping (the norm is still logged)."""
    scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                       "inverse_sqrt"] = "constant_with_warmup"
    """The learning-rate schedule, by its `transformers.get_scheduler` name (those that need no
    argument beyond warmup_steps and total_steps)."""
    warmup_steps: int = Field(0, ge=0)
    total_steps: int = Field(1000, ge=1)
    """Optimiser steps the schedule spans (linear/cosine decay). `sinkflex-rl train` sets it to
    run.steps × grpo.ppo_epochs × grpo.mini_batches unless the section writes it."""


class BatchConfig(StrictModel):
    """How groups become tensors."""

    groups_per_step: int = Field(4, ge=1)
    """Groups consumed by one learner step (one policy version)."""
    micro_batch_size: int = Field(4, ge=1)
    """Rollouts per forward/backward on each rank (gradients accumulate)."""
    max_seq_len: int | None = Field(None, ge=2)
    """Longer trajectories are cut to this many tokens (cut tokens are not trained; counted).
    None: the model's max_position_embeddings."""
    pad_token_id: int = Field(0, ge=0)
    pack_tokens: int | None = Field(None, ge=2)
    """None: one rollout per row, right-padded. L: pack rollouts into rows of at most L
    positions (per-rollout position ids and a document mask; needs the sinkflex path);
    micro_batch_size still counts rollouts."""
    shared_prefix: bool = True
    """Pack each group's rollouts (up to micro_batch_size of them) as one row [prefix | suffix_1 |
    … | suffix_G] so that the shared prompt is computed once (exact: same log-probs, loss and
    gradients as unshared rows); needs the sinkflex attention path."""
    shared_prefix_across_groups: bool = False
    """Share one prefix across groups too: consecutive rollouts of the step (group after group,
    up to micro_batch_size of them) form one row with their common prefix (e.g. the system
    prompt and tool schemas every task of a domain starts with), instead of one row per group.
    Same exactness; fewer positions computed when tasks share a long prompt."""
    shared_prefix_min_tokens: int = Field(64, ge=1)
    """A group whose common prefix is shorter trains on unshared rows (counted in the metrics
    as shared_prefix_fallback_groups)."""


class BufferConfig(StrictModel):
    """The Redis trajectory buffer (sinkflex.buffer)."""

    url: str | None = None
    """Redis URL; None: $REDIS_URL, else the embedded server."""
    stream: str = "sinkflex:groups"
    consumer_group: str = "learner"
    consumer: str = "learner-0"
    """Consumer name; keep it across restarts so that this learner's pending groups come back."""
    block_ms: int = Field(1000, ge=0)
    """How long one read waits for new groups (the loop ticks at least this often)."""
    claim_idle_ms: int = Field(300_000, ge=1)
    """A group delivered and not acknowledged for this long is redelivered (to this learner
    after a restart, or to another). Must exceed checkpoint_every steps of training."""
    max_deliveries: int = Field(3, ge=1)
    """A group delivered more often than this without being acknowledged (its step raised, or
    the learner died, each time) goes to the dead-letter stream instead of a further try."""
    keep_acked: int = Field(64, ge=0)
    """Acknowledged groups kept in the stream as history; older ones are deleted at ack."""


class SFTConfig(StrictModel):
    """How the supervised warm start trains (learner_service/sft.py): the one definition of its
    hyperparameters, used by the learner's `WarmStartConfig` and the experiment's `warm_start`
    section (sinkflex_rl/config.py)."""

    epochs: int = Field(2, ge=1)
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate of the warm start (its own optimiser; the GRPO one is untouched)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW ε of the warm start's optimiser (independent of optim.eps, the GRPO one's)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many optimiser steps."""
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(8, ge=1)
    """Demonstrations per optimiser step (split into micro-batches of batch.micro_batch_size)."""


class WarmStartConfig(SFTConfig):
    """Supervised warm start on demonstrations before GRPO (learner_service/sft.py)."""

    demonstrations: str | None = None
    """File of length-delimited TrajectoryGroups (written by the driver from golden actions);
    None: no warm start. Trained once, when the learner starts at policy version 0."""


class LearnerConfig(StrictModel):
    """Everything `python -m learner_service` needs."""

    run_dir: str = "runs/learner"
    """Checkpoints (<run_dir>/checkpoints), policy versions (<run_dir>/policy/v{N}), metrics."""
    model: ModelConfig
    grpo: GRPOConfig = GRPOConfig()
    optim: OptimConfig = OptimConfig()
    batch: BatchConfig = BatchConfig()
    buffer: BufferConfig = BufferConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    checkpoint_every: int = Field(1, ge=1)
    """Steps between checkpoints. Groups are acknowledged only after the checkpoint that
    records them, so a larger value leaves more groups pending in the stream. A version is
    published only once it is checkpointed, so every publish (publish_every) checkpoints too."""
    keep_checkpoints: int = Field(2, ge=1)
    publish_every: int = Field(1, ge=1)
    """Steps between published policy versions (<run_dir>/policy/v{N} + UpdateWeights)."""
    keep_policies: int = Field(3, ge=1)
    """Policy versions kept in <run_dir>/policy/: the newest `keep_policies`, plus the warm
    start's version (the reference policy), which is never pruned; older ones are deleted."""
    rollout_address: str | None = None
    """host:port of the RolloutService to call UpdateWeights on; None: only write the folder."""
    tensorboard: bool = True
    max_staleness: int | None = Field(None, ge=0)
    """Off-policy bound k: a group is trained only if (the learner's policy version when it trains)
    − (the oldest policy version of any of its turns) ≤ k; older groups are dropped, acknowledged
    untrained and counted (metrics dropped_stale_groups, dropped_stale_groups_total). 0: on-policy
    only. None: no bound. The experiment sets it to rollout.max_staleness (docs/async.md)."""
    step_delay_s: float = Field(0.0, ge=0)
    """Testing and benchmarks only: sleep this long before every learner step (a learner slowed
    on purpose; counted as busy, not idle). 0: off."""
    tls: TLSConfig = Field(
        default_factory=TLSConfig,
        description="TLS / mutual TLS of the gRPC server, and of this service's clients (sinkflex.tls; default: plaintext).",
    )


def load_learner_config(path: str | Path) -> LearnerConfig:
    """Loads and validates a learner YAML config. Raises sinkflex.config.ConfigError."""
    return load_config(path, LearnerConfig)
