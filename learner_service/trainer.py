"""The GRPO learner: one `train_step(groups)` = one new policy version.

A step, top to bottom (every rank runs it on the same groups; rank r trains its share):
1. take the groups as `batch.Group`s (rollouts and advantages, eq. 3, computed once: by
   the loop where rank 0 read them, or here for protos passed in); drop groups already
   trained (by group id) and, if configured, zero-variance groups (logged);
2. π_θold: the engine's log-probs, or recomputed with the current weights (no grad);
   π_ref (when β > 0; no reference model otherwise): the frozen policy RL starts from,
   i.e. the warm start's weights after a warm start (`Learner.set_reference`), else the
   initial model;
3. for each PPO epoch, shuffle and split into mini-batches; for each mini-batch, the
   global token count N is all-reduced; with β = 0 the rollouts whose advantage is exactly
   0 are left out of the forward/backward (`grpo.skip_zero_advantage`, default on: exact,
   their tokens stay in N); each rank runs its micro-batches (`batch.plan_micro_batches`;
   loss sum / N, gradients accumulate, FSDP sums them over ranks), clips the global
   gradient norm and takes one AdamW step and one scheduler step (`optimizer_step`);
4. policy_version += 1, the groups' ids are recorded as trained, metrics are written
   (`learner_service.metrics.step_metrics`).

Shared prefixes (batch.shared_prefix, default on): the rollouts of one group in a micro-step
are packed as one row [prefix | suffix_1 | … | suffix_G] (batch.pack_shared) and the prompt
is computed once; the loss, its normaliser Σ_i T_i and every gradient are those of the
unshared rows (the prefix's gradient is the sum of its G copies'). With
batch.shared_prefix_across_groups the row holds up to micro_batch_size rollouts of several
groups with their common prefix (a domain's system prompt and tool schemas), exact in the
same way. Rollouts whose common prefix is shorter than batch.shared_prefix_min_tokens are
trained on unshared rows (metrics: shared_prefix_rows, shared_prefix_fallback_groups,
positions_computed).
The warm start (learner_service/sft.py) trains through the same public pieces: `micro_batches`,
`global_tokens`, `logits` and `optimizer_step`.
Precision (model.dtype auto): on CUDA bfloat16 weights; on a CPU where bfloat16 is measured
fast (sinkflex.hardware.bf16_verdict: AMX, AMD's avx512_bf16) bfloat16 autocast over fp32
weights; fp32 elsewhere (model.resolve_precision).
Log-softmax, LSE and the GRPO ratio are float32 in every case. logprob_mismatch_mean /
_max: |engine log-prob − learner log-prob| on the loss-mask tokens of the first mini-batch
of the first epoch (before this step's first update).

Departures from the paper: several optimiser steps per version (PPO epochs ×
mini-batches of whole groups) are an option (default one); the token count N is per
mini-batch (the batch of one optimiser step), which is the paper's Σ T_i when there is
one mini-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import resource
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

from learner_service.batch import (
    Group,
    GroupInfo,
    LayoutCounts,
    PickedBatch,
    Rollout,
    plan_micro_batches,
    shard_for_rank,
)
from learner_service.config import LearnerConfig
from learner_service.logprobs import rollout_logprobs
from learner_service.loss import grpo_loss
from learner_service.metrics import LogprobMismatch, StepTotals, step_metrics
from learner_service.model import build_model, freeze, resolve_precision, shard_model
from sinkflex.api.common.v1 import common_pb2
from sinkflex.attention import generate_document, generate_shared_prefix
from sinkflex.attention.hf import layer_masks, mask_override
from sinkflex.reporting import MetricsWriter

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
    groups_dropped_stale: int = 0  # groups read and not trained: older than max_staleness allows


def _dist() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else CPU."""
    if torch.cuda.is_available():
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
        self.cfg = cfg
        self.rank, self.world = _dist()
        self.device = device or default_device()
        self.precision = resolve_precision(cfg.model, self.device)
        log.info("learner precision: %s", self.precision.describe())
        model = build_model(cfg.model, self.device)
        self.arch_name = type(model).__name__
        if cfg.batch.pack_tokens is not None and cfg.model.attn_implementation != "sinkflex":
            raise ValueError("batch.pack_tokens needs model.attn_implementation 'sinkflex' (document mask)")
        self.shared_prefix = cfg.batch.shared_prefix and cfg.model.attn_implementation == "sinkflex"
        #: zero-advantage rollouts are left out of the training forward/backward (exact only without KL)
        self._skips_zero_advantage = cfg.grpo.skip_zero_advantage and cfg.grpo.beta == 0
        if cfg.batch.shared_prefix and not self.shared_prefix:
            log.warning("batch.shared_prefix needs model.attn_implementation 'sinkflex': training on unshared rows")
        self.model = shard_model(model)
        self.ref_model = None
        #: policy version whose weights the KL reference holds (0: the initial model)
        self.reference_version = 0
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
            self.writer = MetricsWriter(cfg.run_dir, tensorboard=cfg.tensorboard)

    # ------------------------------------------------------------------ bookkeeping
    def is_trained(self, group_id: str) -> bool:
        return group_id in self._trained

    def record_trained(self, group_ids: Sequence[str]) -> None:
        for g in group_ids:
            if g not in self._trained:
                self._trained.add(g)
                self.state.trained_group_ids.append(g)

    # ------------------------------------------------------------------ forward
    def _autocast(self):
        """bfloat16 autocast when the precision says so (model.resolve_precision), else nothing."""
        if self.precision.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast)
    def logits(self, model: torch.nn.Module, pb: PickedBatch) -> torch.Tensor:
        """[B·J, V] logits of `pb` at its kept columns `pb.keep_J` (model dtype, or bf16 under
        autocast), flattened over rows: the rows its picks index (`pb.pick_row_K`).

        Shared-prefix rows get the shared-prefix mask (`sinkflex.attention.generate_shared_prefix`,
        through `hf.mask_override`); packed rows per-rollout positions and a document mask
        (Llama-family models detect packed rows from position_ids themselves; gpt-oss is handed
        the document mask, one per layer type); padded rows nothing (causal attention, right padding).
        """
        ids, pos, docs = pb.input_ids_BN, pb.position_ids_BN, pb.doc_ids_BN
        kw = {"use_cache": False, "logits_to_keep": pb.keep_J}
        with self._autocast():
            if pb.segment_ids_BN is not None:
                with mask_override(generate_shared_prefix(pb.segment_ids_BN, pos)):
                    logits_BJV = model(input_ids=ids, position_ids=pos, **kw).logits
            elif docs is None:
                logits_BJV = model(input_ids=ids, **kw).logits
            elif model.config.model_type != "gpt_oss":
                logits_BJV = model(input_ids=ids, position_ids=pos, **kw).logits
            else:
                mask = layer_masks(model.config, generate_document(docs))
                logits_BJV = model(input_ids=ids, position_ids=pos, attention_mask=mask, **kw).logits
        return logits_BJV.flatten(0, 1)

    def micro_batches(self, rollouts: list[Rollout], idx: list[int]) -> tuple[list[PickedBatch], LayoutCounts]:
        """This rank's micro-batches of the mini-batch `idx` (CPU), as many on every rank
        (`batch.plan_micro_batches` with this learner's batch config, rank and world size)."""
        bc = self.cfg.batch
        return plan_micro_batches(
            rollouts, idx, rank=self.rank, world=self.world, micro_batch_size=bc.micro_batch_size,
            shared_prefix=self.shared_prefix, shared_prefix_across_groups=bc.shared_prefix_across_groups,
            shared_prefix_min_tokens=bc.shared_prefix_min_tokens, pad_token_id=bc.pad_token_id, pack_tokens=bc.pack_tokens,
        )

    def global_tokens(self, rollouts: list[Rollout], idx: list[int]) -> float:
        """N = Σ_i T_i, the loss-mask tokens of the mini-batch `idx` over all ranks (each rank
        counts its share, `batch.shard_for_rank`; one all-reduce)."""
        mine = shard_for_rank(idx, rollouts, self.rank, self.world)
        n = torch.tensor([float(sum(int(rollouts[i].mask_T.sum()) for i in mine))], dtype=torch.float64)
        self.all_reduce_(n)
        return n.item()

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Per-rollout log-probs [T] under `model` (no grad; 0 off the loss mask), each rank scoring its share."""
        g = self.cfg.grpo
        idx = list(range(len(rollouts)))
        mine: dict[int, torch.Tensor] = {}
        batches, _ = self.micro_batches(rollouts, idx)
        for pb in batches:
            pb = pb.to(self.device)
            logp_RT, _ = rollout_logprobs(self.logits(model, pb), pb, g.temperature, top_k=g.top_k, top_p=g.top_p)
            for i, row, start in pb.segments:
                mine[i] = logp_RT[row, start : start + rollouts[i].num_positions].float().cpu()
        if self.world > 1:
            parts: list[dict[int, torch.Tensor] | None] = [None] * self.world
            dist.all_gather_object(parts, mine)
            for p in parts:
                mine.update(p or {})
        return [mine[i] for i in idx]

    def set_reference(self, state_dict: dict[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        """Makes π_ref of the KL term (`grpo.beta`) the given weights; a no-op when beta = 0.

        RL's reference is the policy RL starts from: the initial model, or the warm start's
        policy when there is one (learner_service/sft.py calls this after the warm start;
        `loop.LearnerRunner.run` reloads it from the published warm-start version on resume).
        Collective under torchrun (`torch.distributed.checkpoint.state_dict.set_model_state_dict`
        with a full state dict broadcast from rank 0).

        Args:
            state_dict: a full (unsharded) state dict on rank 0 ({} on other ranks); default:
                the learner's current weights.
            version: the policy version those weights are (default: the current one).
        """
        if self.ref_model is None:
            return
        if state_dict is None:
            state_dict = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=self.world > 1, strict=False)
        set_model_state_dict(self.ref_model, state_dict, options=opts)
        self.reference_version = self.state.policy_version if version is None else version
        log.info("KL reference: policy version %d", self.reference_version)

    # ------------------------------------------------------------------ the step
    def to_group(self, group: Group | common_pb2.TrajectoryGroup) -> Group:
        """`group` as a `batch.Group`: as it is when it already is one (the loop's, converted
        once where it was read), else converted with this learner's config (advantages,
        max_seq_len, reward shaping).

        Raises:
            ValueError: a malformed group (see batch.Group.from_proto).
        """
        if isinstance(group, Group):
            return group
        return Group.from_proto(group, self.cfg.grpo.adv_eps, self.cfg.batch.max_seq_len, self.cfg.grpo.reward_shaping)

    def prepare(self, groups: Sequence[Group | common_pb2.TrajectoryGroup]) -> tuple[list[Rollout], list[GroupInfo], dict[str, float]]:
        """Drops duplicates / already-trained / (optionally) zero-variance groups; converts the
        protos among `groups` (`to_group`; `Group`s are used as they are).

        Raises:
            ValueError: a malformed group (see batch.Group.from_proto).
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
            typed = self.to_group(g)
            rs, info = typed.rollouts, typed.info
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

    def train_step(self, groups: Sequence[Group | common_pb2.TrajectoryGroup],
                   extra_metrics: dict[str, float] | None = None) -> dict[str, float]:
        """One learner step on `groups` (every rank must pass the same groups); `extra_metrics`
        (the loop's: idle time, dropped groups) are written with the step's own.

        `groups` are `batch.Group`s (the loop's: decoded once, where rank 0 read them) or
        TrajectoryGroup protos, converted here once each (`to_group`).

        Returns:
            the step's metrics (`learner_service.metrics` names them); with no trainable
            rollout (all duplicate or filtered) the weights and the policy version do not
            change and metrics["skipped"] = 1.

        Raises:
            ValueError: a malformed group.
        """
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        g = self.cfg.grpo
        # 1. the groups: duplicates dropped, zero-variance ones filtered when configured
        rollouts, infos, counts = self.prepare(groups)
        version_at_training = self.state.policy_version
        if not rollouts:
            self._record_step(infos, new_version=False)
            return self._finish({**counts, "skipped": 1.0, **(extra_metrics or {})}, t0)

        # 2. π_θold (the engine's, or recomputed) and π_ref (when β > 0)
        mismatch = LogprobMismatch()  # engine vs learner, loss mask
        if g.old_logprobs == "recompute":
            old = self._score(self.model, rollouts)
            for r, o in zip(rollouts, old):
                mismatch.add((r.old_logp_T - o).abs()[r.mask_T].double())
            rollouts = [dataclasses.replace(r, old_logp_T=o) for r, o in zip(rollouts, old)]
        ref = self._score(self.ref_model, rollouts) if self.ref_model is not None else None

        # 3. PPO epochs × mini-batches of whole groups, one optimiser step each
        totals = StepTotals()
        grad_norms: list[float] = []
        for epoch in range(g.ppo_epochs):
            for k, mb in enumerate(self._mini_batches(rollouts)):
                if not mb:
                    continue
                # engine vs learner before any update: the first mini-batch of the first epoch
                track = mismatch if (epoch == 0 and k == 0 and g.old_logprobs == "engine") else None
                gn = self._train_mini_batch(rollouts, mb, ref, totals, track)
                if gn is not None:
                    grad_norms.append(gn)
        totals.all_reduce(self.all_reduce_)
        mismatch.all_reduce(self.all_reduce_, self._all_reduce_max_)

        # 4. the new policy version and its metrics
        self._record_step(infos, new_version=True)
        metrics = step_metrics(
            grpo=g, totals=totals, mismatch=mismatch, grad_norms=grad_norms, lr=float(self.scheduler.get_last_lr()[0]),
            infos=infos, rollouts=rollouts, policy_version=version_at_training, nonfinite_grad_steps=self.skipped_nonfinite,
        )
        return self._finish({**counts, **metrics, **(extra_metrics or {})}, t0)

    def _mini_batches(self, rollouts: list[Rollout]) -> list[list[int]]:
        """The step's rollouts shuffled by group and split into `grpo.mini_batches` mini-batches
        of whole groups (indices into `rollouts`, each group's in group order; with fewer groups
        than mini-batches some are empty)."""
        members: dict[str, list[int]] = {}  # group id -> its rollouts' indices, in group order
        for i, r in enumerate(rollouts):
            members.setdefault(r.group_id, []).append(i)
        group_ids = list(members)
        n, m = len(group_ids), self.cfg.grpo.mini_batches
        perm = torch.randperm(n, generator=self.shuffle_gen).tolist()
        mbs = [[i for j in perm[k * n // m : (k + 1) * n // m] for i in members[group_ids[j]]] for k in range(m)]
        return mbs

    def _record_step(self, infos: Sequence[GroupInfo], new_version: bool) -> None:
        """The groups as trained; with `new_version`, policy_version and step + 1. `step` last:
        a reader polling it (the Status RPC thread) then sees the rest updated."""
        self.record_trained([i.group_id for i in infos])
        self.state.groups_trained += len(infos)
        if new_version:
            self.state.policy_version += 1
            self.state.step += 1

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

    def _train_mini_batch(
        self,
        rollouts: list[Rollout],
        mb: list[int],
        ref: list[torch.Tensor] | None,
        totals: StepTotals,
        mismatch: LogprobMismatch | None = None,
    ) -> float | None:
        """Forward/backward over this rank's share of mini-batch `mb`, then one optimiser step.

        Returns:
            the gradient norm, or None when no step was taken (no loss-mask token, or a
            non-finite norm).
        """
        g = self.cfg.grpo
        n_tokens = self.global_tokens(rollouts, mb)  # N = Σ_i T_i over the global mini-batch
        if n_tokens == 0:
            return None
        if self._skips_zero_advantage:
            # exact (β = 0): a rollout with Â = 0 adds exactly 0 to the loss and every gradient;
            # its tokens are in N above. The filter is the same on every rank (same mb).
            mine = shard_for_rank(mb, rollouts, self.rank, self.world)
            totals.add_skipped([rollouts[i] for i in mine if rollouts[i].advantage == 0.0])
            mb = [i for i in mb if rollouts[i].advantage != 0.0]
        batches, layout = self.micro_batches(rollouts, mb)
        totals.add_layout(layout)
        for pb in batches:
            pb = pb.to(self.device)
            logp_RT, ent_RT = rollout_logprobs(self.logits(self.model, pb), pb, g.temperature, entropy=True,
                                               top_k=g.top_k, top_p=g.top_p)
            ref_RT = None
            if ref is not None:
                ref_RT = torch.zeros_like(pb.old_logp_RT)
                for i, row, start in pb.segments:
                    ref_RT[row, start : start + rollouts[i].num_positions] = ref[i].to(self.device)
            loss, terms = grpo_loss(
                logp_RT, pb.old_logp_RT, pb.adv_RT, pb.mask_RT, num_tokens=n_tokens,
                clip_eps_low=g.clip_eps_low, clip_eps_high=g.clip_eps_high, ref_logp_BT=ref_RT, beta=g.beta,
            )
            loss.backward()
            positions = sum(rollouts[i].num_positions for i, _, _ in pb.segments)
            with torch.no_grad():
                m = pb.mask_RT
                if mismatch is not None and bool(m.any()):
                    mismatch.add((logp_RT.detach().double() - pb.old_logp_RT.double()).abs()[m])
                totals.add_terms(terms, ent_RT[m].sum().item(), positions, pb.positions_computed)
            del logp_RT, ent_RT, loss
        grad_norm = self.optimizer_step(self.optimizer, self.scheduler)
        if not math.isfinite(grad_norm):
            self.skipped_nonfinite += 1
            return None
        self.state.optimizer_steps += 1
        return grad_norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer, scheduler=None) -> float:
        """One step of `optimizer` (and `scheduler`) on the accumulated gradients, then zeroes them.

        The global gradient norm (over all ranks) is clipped to optim.max_grad_norm first. A
        non-finite norm skips the step (logged; the gradients are dropped), so one bad batch
        never reaches the weights. Used by GRPO and by the warm start (its own optimiser).

        Returns:
            the global gradient norm before clipping (non-finite: no step was taken).
        """
        grad_norm = self._clip_grad()
        if not math.isfinite(grad_norm):
            log.error("non-finite gradient norm %s: optimiser step skipped", grad_norm)
            optimizer.zero_grad(set_to_none=True)
            return grad_norm
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def all_reduce_(self, t: torch.Tensor, op=None) -> None:
        """In-place sum (or `op`) over ranks of a CPU tensor (moved to the GPU and back for NCCL)."""
        if self.world == 1:
            return
        x = t.to(self.device) if dist.get_backend() == "nccl" else t
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op)
        if x is not t:
            t.copy_(x.cpu())

    def _all_reduce_max_(self, t: torch.Tensor) -> None:
        """In-place max over ranks of a CPU tensor."""
        self.all_reduce_(t, dist.ReduceOp.MAX)

    def _clip_grad(self) -> float:
        """Global gradient norm over all ranks (DTensor-aware), clipped to max_grad_norm."""
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
