"""The GRPO learner: one `train_step(groups)` = one new policy version.

A step, top to bottom (every rank runs it on the same groups; rank r trains its share):
1. convert the groups (batch.py), compute advantages (eq. 3); drop groups already
   trained (by group id) and, if configured, zero-variance groups (logged);
2. π_θold: the engine's log-probs, or recomputed with the current weights (no grad);
   π_ref: the frozen initial model when β > 0 (no reference model otherwise);
3. for each PPO epoch, shuffle and split into mini-batches; for each mini-batch, the
   global token count N is all-reduced, each rank runs its micro-batches (loss sum / N,
   gradients accumulate, FSDP sums them over ranks), clips the global gradient norm and
   takes one AdamW step and one scheduler step;
4. policy_version += 1, the groups' ids are recorded as trained, metrics are written.

Departures from the paper: several optimiser steps per version (PPO epochs ×
mini-batches) are an option (default one); the token count N is per mini-batch (the
batch of one optimiser step), which is the paper's Σ T_i when there is one mini-batch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from learner_service.batch import (
    GroupInfo,
    Rollout,
    micro_batches,
    num_micro_steps,
    pack,
    rollouts_from_group,
    shard_for_rank,
)
from learner_service.config import LearnerConfig
from learner_service.logprobs import token_entropy, token_logprobs
from learner_service.loss import grpo_loss
from learner_service.model import build_model, freeze, shard_model
from sinkflex.api.common.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LearnerState:
    """What a checkpoint restores besides weights and optimiser."""

    step: int = 0  # learner steps taken
    policy_version: int = 0  # version of the current weights (0: initial)
    optimizer_steps: int = 0
    groups_trained: int = 0  # groups consumed (trained, filtered or duplicate)
    trained_group_ids: list[str] = dataclasses.field(default_factory=list)
    published_version: int = -1
    published_location: str = ""
    warm_start_version: int = 0  # policy version the warm start published (0: no warm start)


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else CPU."""
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class Learner:
    """GRPO on a transformers causal LM, FSDP2-sharded under torchrun, plain otherwise.

    Args:
        cfg: the learner config.
        device: defaults to `default_device()`.
        metrics: write metrics to <run_dir>/metrics.jsonl and TensorBoard (rank 0 only).
    """

    def __init__(self, cfg: LearnerConfig, device: torch.device | None = None, metrics: bool = True):
        from transformers import get_scheduler

        self.cfg = cfg
        self.rank, self.world = _dist()
        self.device = device or default_device()
        model = build_model(cfg.model, self.device)
        self.arch_name = type(model).__name__
        if cfg.batch.pack_tokens is not None and cfg.model.attn_implementation != "sinkflex":
            raise ValueError("batch.pack_tokens needs model.attn_implementation 'sinkflex' (document mask)")
        self.model = shard_model(model)
        self.ref_model = None
        if cfg.grpo.beta > 0:
            self.ref_model = shard_model(freeze(build_model(cfg.model.model_copy(update={"gradient_checkpointing": False}), self.device)))
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = get_scheduler(o.scheduler, self.optimizer, num_warmup_steps=o.warmup_steps, num_training_steps=o.total_steps)
        self.shuffle_gen = torch.Generator().manual_seed(cfg.model.seed)
        self.state = LearnerState()
        self._trained: set[str] = set()
        self.last_metrics: dict[str, float] = {}
        self.skipped_nonfinite = 0  # optimiser steps skipped for a non-finite gradient norm
        self.writer = None
        if metrics and self.rank == 0:
            from sinkflex.reporting import MetricsWriter

            self.writer = MetricsWriter(cfg.run_dir, tensorboard=cfg.tensorboard)

    # ------------------------------------------------------------------ bookkeeping
    def is_trained(self, group_id: str) -> bool:
        return group_id in self._trained

    def record_trained(self, group_ids: Sequence[str]) -> None:
        for g in group_ids:
            if g not in self._trained:
                self._trained.add(g)
                self.state.trained_group_ids.append(g)

    # ------------------------------------------------------------------ log-probs
    def _logits(self, model: torch.nn.Module, b) -> torch.Tensor:
        """[B, T, V] logits of a TrainBatch; packed rows get per-rollout positions and a document mask."""
        if b.doc_ids_BT is None:
            return model(input_ids=b.input_ids_BT, use_cache=False).logits
        if model.config.model_type != "gpt_oss":
            # Llama-family models detect packed rows from position_ids themselves (use_cache off).
            return model(input_ids=b.input_ids_BT, position_ids=b.position_ids_BT, use_cache=False).logits
        from sinkflex.attention import generate_document
        from sinkflex.attention.hf import layer_masks

        # gpt-oss does not detect packing: hand it the document mask, one per layer type.
        mask = layer_masks(model.config, generate_document(b.doc_ids_BT))
        return model(input_ids=b.input_ids_BT, position_ids=b.position_ids_BT, attention_mask=mask, use_cache=False).logits

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Per-rollout log-probs [T] under `model` (no grad), each rank scoring its share."""
        idx = list(range(len(rollouts)))
        shares = [shard_for_rank(idx, rollouts, r, self.world) for r in range(self.world)]
        size = self.cfg.batch.micro_batch_size
        steps = max(num_micro_steps(len(s), size) for s in shares)
        mine: dict[int, torch.Tensor] = {}
        for mb in micro_batches(shares[self.rank], size, steps):
            b = pack(rollouts, mb, self.cfg.batch.pad_token_id, self.cfg.batch.pack_tokens).to(self.device)
            logp_BT = token_logprobs(self._logits(model, b), b.target_ids_BT, self.cfg.grpo.temperature)
            for i, row, start in b.segments:
                mine[i] = logp_BT[row, start : start + rollouts[i].num_positions].float().cpu()
        if self.world > 1:
            parts: list[dict[int, torch.Tensor] | None] = [None] * self.world
            dist.all_gather_object(parts, mine)
            for p in parts:
                mine.update(p or {})
        return [mine[i] for i in idx]

    # ------------------------------------------------------------------ the step
    def prepare(self, groups: Sequence[common_pb2.TrajectoryGroup]) -> tuple[list[Rollout], list[GroupInfo], dict[str, float]]:
        """Converts groups, drops duplicates / already-trained / (optionally) zero-variance ones.

        Raises:
            ValueError: a malformed group (see batch.rollouts_from_group).
        """
        rollouts: list[Rollout] = []
        infos: list[GroupInfo] = []
        seen: set[str] = set()
        dup = zero_var = filtered = truncated = 0
        for g in groups:
            if g.group_id in seen or self.is_trained(g.group_id):
                dup += 1
                continue
            seen.add(g.group_id)
            rs, info = rollouts_from_group(g, self.cfg.grpo.adv_eps, self.cfg.batch.max_seq_len)
            infos.append(info)
            zero_var += info.zero_variance
            if info.zero_variance and self.cfg.grpo.filter_zero_variance:
                filtered += 1
                continue
            truncated += sum(r.truncated_tokens for r in rs)
            rollouts.extend(rs)
        counts = {
            "groups": float(len(infos)),
            "duplicate_groups": float(dup),
            "zero_variance_groups": float(zero_var),
            "filtered_groups": float(filtered),
            "truncated_tokens": float(truncated),
        }
        if zero_var:
            log.info("%d zero-variance group(s) %s", zero_var, "filtered" if self.cfg.grpo.filter_zero_variance else "kept")
        return rollouts, infos, counts

    def train_step(self, groups: Sequence[common_pb2.TrajectoryGroup]) -> dict[str, float]:
        """One learner step on `groups` (every rank must pass the same groups).

        Returns:
            the step's metrics (see module docstring of learner_service.metrics names); with
            no trainable rollout (all duplicate or filtered) the weights and the policy
            version do not change and metrics["skipped"] = 1.

        Raises:
            ValueError: a malformed group.
        """
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        g = self.cfg.grpo
        rollouts, infos, counts = self.prepare(groups)
        version_at_training = self.state.policy_version
        if not rollouts:
            self.record_trained([i.group_id for i in infos])
            self.state.groups_trained += len(infos)
            return self._finish({**counts, "skipped": 1.0}, t0)

        if g.old_logprobs == "recompute":
            old = self._score(self.model, rollouts)
            rollouts = [dataclasses.replace(r, old_logp_T=o) for r, o in zip(rollouts, old)]
        ref = self._score(self.ref_model, rollouts) if self.ref_model is not None else None

        sums = torch.zeros(7, dtype=torch.float64)  # pg, kl, clipped, ratio, tokens, entropy, positions
        grad_norms: list[float] = []
        n = len(rollouts)
        for _epoch in range(g.ppo_epochs):
            perm = torch.randperm(n, generator=self.shuffle_gen).tolist()
            for mb in [perm[k * n // g.mini_batches : (k + 1) * n // g.mini_batches] for k in range(g.mini_batches)]:
                if mb:
                    gn = self._optimizer_step(rollouts, mb, ref, sums)
                    if gn is not None:
                        grad_norms.append(gn)
        self._all_reduce_(sums)
        # `step` last: a reader polling it (the Status RPC thread) then sees the rest updated.
        self.record_trained([i.group_id for i in infos])
        self.state.groups_trained += len(infos)
        self.state.policy_version += 1
        self.state.step += 1

        tok = max(sums[4].item(), 1.0)
        rewards = torch.cat([i.rewards_G for i in infos])
        valid = rewards[~torch.isnan(rewards)]
        adv = torch.tensor([r.advantage for r in rollouts])
        stale = torch.tensor([float(version_at_training - r.policy_version) for r in rollouts])
        metrics = {
            **counts,
            "loss": (sums[0].item() + g.beta * sums[1].item()) / tok,
            "pg_loss": sums[0].item() / tok,
            "kl": sums[1].item() / tok,
            "clip_fraction": sums[2].item() / tok,
            "ratio_mean": sums[3].item() / tok,
            "entropy": sums[5].item() / tok,
            "grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "reward_mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward_std": float(valid.std(unbiased=False)) if valid.numel() else float("nan"),
            "reward_nan": float(torch.isnan(rewards).sum()),
            "adv_mean": float(adv.mean()),
            "adv_std": float(adv.std(unbiased=False)),
            "adv_min": float(adv.min()),
            "adv_max": float(adv.max()),
            "adv_zero_fraction": float((adv == 0).float().mean()),
            "staleness_mean": float(stale.mean()),
            "staleness_max": float(stale.max()),
            "rollouts": float(n),
            "optimised_tokens": sums[4].item() / g.ppo_epochs,
            "optimizer_steps": float(len(grad_norms)),
            "positions_trained": sums[6].item(),
            "nonfinite_grad_steps": float(self.skipped_nonfinite),
        }
        return self._finish(metrics, t0)

    def _finish(self, metrics: dict[str, float], t0: float) -> dict[str, float]:
        dt = time.perf_counter() - t0
        metrics["step_seconds"] = dt
        metrics["tokens_per_s"] = metrics.get("positions_trained", 0.0) / dt if dt > 0 else 0.0
        if self.device.type == "cuda":
            metrics["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        else:  # process high-water mark (Linux: KiB)
            metrics["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        metrics["policy_version"] = float(self.state.policy_version)
        metrics["step"] = float(self.state.step)
        self.last_metrics = metrics
        if self.writer is not None:
            self.writer.write("train", self.state.step, metrics)
        return metrics

    def _optimizer_step(
        self, rollouts: list[Rollout], mb: list[int], ref: list[torch.Tensor] | None, sums: torch.Tensor
    ) -> float | None:
        """Forward/backward over this rank's share of mini-batch `mb`, then one AdamW step."""
        g, size = self.cfg.grpo, self.cfg.batch.micro_batch_size
        shares = [shard_for_rank(mb, rollouts, r, self.world) for r in range(self.world)]
        mine = shares[self.rank]
        n_local = torch.tensor([float(sum(int(rollouts[i].mask_T.sum()) for i in mine))], dtype=torch.float64)
        self._all_reduce_(n_local)  # N = Σ_i T_i over the global mini-batch
        n_tokens = n_local.item()
        if n_tokens == 0:
            return None
        steps = max(num_micro_steps(len(s), size) for s in shares)
        for micro in micro_batches(mine, size, steps):
            b = pack(rollouts, micro, self.cfg.batch.pad_token_id, self.cfg.batch.pack_tokens).to(self.device)
            logits_BTV = self._logits(self.model, b)
            logp_BT = token_logprobs(logits_BTV, b.target_ids_BT, g.temperature)
            ref_BT = None
            if ref is not None:
                ref_BT = torch.zeros_like(b.old_logp_BT)
                for i, row, start in b.segments:
                    ref_BT[row, start : start + rollouts[i].num_positions] = ref[i].to(self.device)
            loss, terms = grpo_loss(
                logp_BT, b.old_logp_BT, b.adv_BT, b.mask_BT, n_tokens, g.clip_eps_low, g.clip_eps_high, ref_BT, g.beta
            )
            loss.backward()
            ent = token_entropy(logits_BTV.detach(), g.temperature)
            positions = sum(rollouts[i].num_positions for i in micro)
            sums += torch.tensor(
                [
                    terms.pg_sum.item(),
                    terms.kl_sum.item(),
                    terms.clipped_tokens.item(),
                    terms.ratio_sum.item(),
                    terms.tokens.item(),
                    ent[b.mask_BT].sum().item(),
                    positions,
                ],
                dtype=torch.float64,
            )
            del logits_BTV, logp_BT, loss
        grad_norm = self._clip_grad()
        if not math.isfinite(grad_norm):  # never let one bad batch destroy the weights
            log.error("non-finite gradient norm %s: optimiser step skipped", grad_norm)
            self.skipped_nonfinite += 1
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.optimizer_steps += 1
        return grad_norm

    def _all_reduce_(self, t: torch.Tensor) -> None:
        """In-place sum over ranks of a CPU tensor (moved to the GPU and back for NCCL)."""
        if self.world == 1:
            return
        x = t.to(self.device) if dist.get_backend() == "nccl" else t
        dist.all_reduce(x)
        if x is not t:
            t.copy_(x.cpu())

    def _clip_grad(self) -> float:
        """Global gradient norm over all ranks (DTensor-aware), clipped to max_grad_norm."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.cfg.optim.max_grad_norm is not None and math.isfinite(total.item()):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.max_grad_norm, total)
        return float(total.item())

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
