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
   their tokens stay in N; in the demo 10–40 % of each step's rollouts); each rank runs its micro-batches (loss sum / N,
   gradients accumulate, FSDP sums them over ranks), clips the global gradient norm and
   takes one AdamW step and one scheduler step;
4. policy_version += 1, the groups' ids are recorded as trained, metrics are written.

Shared prefixes (batch.shared_prefix, default on): the rollouts of one group in a micro-step
are packed as one row [prefix | suffix_1 | … | suffix_G] (batch.pack_shared) and the prompt
is computed once; the loss, its normaliser Σ_i T_i and every gradient are those of the
unshared rows (the prefix's gradient is the sum of its G copies'). With
batch.shared_prefix_across_groups the row holds up to micro_batch_size rollouts of several
groups with their common prefix (a domain's system prompt and tool schemas), exact in the
same way. Rollouts whose common prefix is shorter than batch.shared_prefix_min_tokens are
trained on unshared rows (metrics: shared_prefix_rows, shared_prefix_fallback_groups,
positions_computed).
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
import resource
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from learner_service.batch import (
    Group,
    GroupInfo,
    PickedBatch,
    Rollout,
    micro_batches,
    num_micro_steps,
    pack,
    pack_shared,
    picks_from_batch,
    shared_prefix_pays,
    shard_for_rank,
)
from learner_service.config import LearnerConfig
from learner_service.logprobs import picked_logprobs, token_logprobs
from learner_service.loss import LossTerms, grpo_loss
from learner_service.model import build_model, freeze, resolve_precision, shard_model
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
    groups_dropped_stale: int = 0  # groups read and not trained: older than max_staleness allows


@dataclasses.dataclass
class StepTotals:
    """What one learner step adds up over its micro-batches (and, after `all_reduce`, over
    ranks): sums, never means. Divide a loss term by `terms.tokens` (N = Σ_i T_i) for its
    per-token mean (paper eq. (6)'s normaliser)."""

    terms: LossTerms = dataclasses.field(default_factory=LossTerms.zero)  # Σ of grpo_loss's terms (float64)
    entropy: float = 0.0  # Σ entropy at optimised tokens
    positions: float = 0.0  # the rollouts' predicted positions (what an unshared learner computes)
    positions_computed: float = 0.0  # model positions actually run (shared prefixes once)
    shared_prefix_rows: float = 0.0
    shared_prefix_fallback_groups: float = 0.0
    shared_prefix_positions: float = 0.0
    skipped_rollouts: float = 0.0  # zero-advantage rollouts not run (grpo.skip_zero_advantage)
    skipped_tokens: float = 0.0  # their optimised tokens: part of N, never run
    skipped_positions: float = 0.0  # their positions (not in `positions`)

    def add_terms(self, terms: LossTerms, entropy: float, positions: float, positions_computed: float) -> None:
        """Adds one micro-batch's `grpo_loss` terms (detached sums) and its sizes."""
        self.terms = self.terms + terms
        self.entropy += entropy
        self.positions += positions
        self.positions_computed += positions_computed

    def add_layout(self, stats: dict[str, float]) -> None:
        """Adds `Learner._micro_batches`' shared-prefix counts."""
        self.shared_prefix_rows += stats["shared_prefix_rows"]
        self.shared_prefix_fallback_groups += stats["shared_prefix_fallback_groups"]
        self.shared_prefix_positions += stats["shared_prefix_positions"]

    def all_reduce(self, reduce_: Callable[[torch.Tensor], None]) -> None:
        """Sums every field over ranks with `reduce_` (an in-place all-reduce of a float64
        tensor): the one place the totals are packed into a tensor and unpacked, by name
        (the loss terms by `LossTerms.to_tensor` / `from_tensor`). One collective."""
        names = [f.name for f in dataclasses.fields(self) if f.name != "terms"]
        k = len(dataclasses.fields(LossTerms))
        t = torch.cat([self.terms.to_tensor(), torch.tensor([getattr(self, n) for n in names], dtype=torch.float64)])
        reduce_(t)
        self.terms = LossTerms.from_tensor(t[:k])
        for n, v in zip(names, t[k:].tolist()):
            setattr(self, n, v)


@dataclasses.dataclass
class LogprobMismatch:
    """|engine log-prob − learner log-prob| on loss-mask tokens: Σ, max and token count."""

    total: float = 0.0  # Σ |Δ|
    max: float = 0.0  # max |Δ|
    tokens: float = 0.0

    def add(self, d: torch.Tensor) -> None:
        """Adds the |Δ| of some tokens (a float64 tensor; nothing when empty)."""
        if d.numel():
            self.total += d.sum().item()
            self.max = max(self.max, d.max().item())
            self.tokens += float(d.numel())

    def all_reduce(self, reduce_: Callable[[torch.Tensor], None], reduce_max: Callable[[torch.Tensor], None]) -> None:
        """Σ and token count summed over ranks with `reduce_`, the max with `reduce_max`."""
        s = torch.tensor([self.total, self.tokens], dtype=torch.float64)
        m = torch.tensor([self.max], dtype=torch.float64)
        reduce_max(m)
        reduce_(s)
        self.total, self.tokens = s.tolist()
        self.max = m.item()

    @property
    def mean(self) -> float:
        return self.total / max(self.tokens, 1.0)


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
    def _autocast(self):
        """bfloat16 autocast when the precision says so (model.resolve_precision), else nothing."""
        if self.precision.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast)

    def _logits(self, model: torch.nn.Module, b, keep: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, V] logits of a TrainBatch or PickedBatch (model dtype, or bf16 under autocast).

        Packed rows get per-rollout positions and a document mask; shared-prefix rows the
        shared-prefix mask (`sinkflex.attention.generate_shared_prefix`, through
        `hf.mask_override`). keep: [J] columns to compute logits for (``logits_to_keep``),
        giving [B, J, V]; None: every column.
        """
        ids = b.input_ids_BT if hasattr(b, "input_ids_BT") else b.input_ids_BN
        pos = b.position_ids_BT if hasattr(b, "position_ids_BT") else b.position_ids_BN
        docs = b.doc_ids_BT if hasattr(b, "doc_ids_BT") else b.doc_ids_BN
        kw: dict = {"use_cache": False}
        if keep is not None:
            kw["logits_to_keep"] = keep
        with self._autocast():
            if getattr(b, "segment_ids_BN", None) is not None:
                from sinkflex.attention import generate_shared_prefix
                from sinkflex.attention.hf import mask_override

                with mask_override(generate_shared_prefix(b.segment_ids_BN, pos)):
                    return model(input_ids=ids, position_ids=pos, **kw).logits
            if docs is None:
                return model(input_ids=ids, **kw).logits
            if model.config.model_type != "gpt_oss":
                # Llama-family models detect packed rows from position_ids themselves (use_cache off).
                return model(input_ids=ids, position_ids=pos, **kw).logits
            from sinkflex.attention import generate_document
            from sinkflex.attention.hf import layer_masks

            # gpt-oss does not detect packing: hand it the document mask, one per layer type.
            mask = layer_masks(model.config, generate_document(docs))
            return model(input_ids=ids, position_ids=pos, attention_mask=mask, **kw).logits

    def _micro_batches(self, rollouts: list[Rollout], idx: list[int]) -> tuple[list[list[int] | PickedBatch], dict[str, float]]:
        """This rank's micro-batches of `idx`, the same count on every rank.

        With shared prefixes: every group's rollouts (in chunks of micro_batch_size) whose
        common prefix is ≥ shared_prefix_min_tokens become one shared row each (a
        PickedBatch); the rest are micro-batched unshared as before (lists of indices).
        """
        size, bc = self.cfg.batch.micro_batch_size, self.cfg.batch
        shares = [shard_for_rank(idx, rollouts, r, self.world) for r in range(self.world)]
        plans: list[tuple[list, list[int]]] = []
        stats = {"shared_prefix_rows": 0.0, "shared_prefix_fallback_groups": 0.0, "shared_prefix_positions": 0.0}
        for rank, share in enumerate(shares):
            shared: list[PickedBatch] = []
            rest: list[int] = []
            if self.shared_prefix:
                by_group: dict[str, list[int]] = {}
                for i in share:  # one "group" for all of them when the prefix is shared across groups
                    by_group.setdefault("" if bc.shared_prefix_across_groups else rollouts[i].group_id, []).append(i)
                for members in by_group.values():
                    for c in range(0, len(members), size):
                        chunk = members[c : c + size]
                        if not shared_prefix_pays(rollouts, chunk, bc.shared_prefix_min_tokens):
                            rest.extend(chunk)
                            if rank == self.rank:
                                stats["shared_prefix_fallback_groups"] += len(chunk) > 1
                        elif rank == self.rank:
                            pb = pack_shared(rollouts, chunk, bc.shared_prefix_min_tokens)
                            shared.append(pb)
                            stats["shared_prefix_rows"] += 1
                            stats["shared_prefix_positions"] += pb.prefix_len
                        else:
                            shared.append(None)  # type: ignore[arg-type]  # another rank's: only the count matters
            else:
                rest = list(share)
            plans.append((shared, sorted(rest, key=lambda i: -rollouts[i].num_positions)))
        # at least one micro-step per rank (FSDP collectives), no dummy after shared rows
        steps = max(1, max(len(sh) + (num_micro_steps(len(rest), size) if rest else 0) for sh, rest in plans))
        shared, rest = plans[self.rank]
        return list(shared) + micro_batches(rest, size, steps - len(shared)), stats

    def _picked(self, rollouts: list[Rollout], mb: list[int] | PickedBatch) -> PickedBatch:
        if isinstance(mb, PickedBatch):
            return mb.to(self.device)
        b = pack(rollouts, mb, self.cfg.batch.pad_token_id, self.cfg.batch.pack_tokens)
        return picks_from_batch(b, rollouts).to(self.device)

    def _forward_picks(self, model: torch.nn.Module, pb: PickedBatch, entropy: bool = False):
        """(logp_RT [R, T] float32, 0 off the loss mask; entropy_RT [R, T] or None) of a PickedBatch."""
        logits_BJV = self._logits(model, pb, keep=pb.keep_J)
        logits_NV = logits_BJV.flatten(0, 1)
        g = self.cfg.grpo
        logp_K, ent_N = picked_logprobs(logits_NV, pb.pick_row_K, pb.pick_target_K, g.temperature, entropy=entropy,
                                        top_k=g.top_k, top_p=g.top_p)
        logp_RT = torch.where(pb.mask_RT, logp_K[pb.src_RT], torch.zeros((), dtype=logp_K.dtype, device=logp_K.device))
        ent_RT = None if ent_N is None else ent_N[pb.pick_row_K[pb.src_RT]]
        return logp_RT, ent_RT

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Per-rollout log-probs [T] under `model` (no grad; 0 off the loss mask), each rank scoring its share."""
        idx = list(range(len(rollouts)))
        mine: dict[int, torch.Tensor] = {}
        units, _ = self._micro_batches(rollouts, idx)
        for mb in units:
            pb = self._picked(rollouts, mb)
            logp_RT, _ = self._forward_picks(model, pb)
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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

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
            return self._finish({**counts, "skipped": 1.0, **(extra_metrics or {})}, t0)

        mismatch = LogprobMismatch()  # engine vs learner, loss mask
        if g.old_logprobs == "recompute":
            old = self._score(self.model, rollouts)
            for r, o in zip(rollouts, old):
                mismatch.add((r.old_logp_T - o).abs()[r.mask_T].double())
            rollouts = [dataclasses.replace(r, old_logp_T=o) for r, o in zip(rollouts, old)]
        ref = self._score(self.ref_model, rollouts) if self.ref_model is not None else None

        sums = StepTotals()
        grad_norms: list[float] = []
        n = len(rollouts)
        members: dict[str, list[int]] = {}  # group id -> its rollouts' indices, in group order
        for i, r in enumerate(rollouts):
            members.setdefault(r.group_id, []).append(i)
        group_ids = list(members)
        n_groups = len(group_ids)
        for epoch in range(g.ppo_epochs):
            perm = torch.randperm(n_groups, generator=self.shuffle_gen).tolist()
            for k in range(g.mini_batches):
                mb = [i for j in perm[k * n_groups // g.mini_batches : (k + 1) * n_groups // g.mini_batches] for i in members[group_ids[j]]]
                if mb:
                    # engine vs learner before any update: the first mini-batch of the first epoch
                    track = mismatch if (epoch == 0 and k == 0 and g.old_logprobs == "engine") else None
                    gn = self._optimizer_step(rollouts, mb, ref, sums, track)
                    if gn is not None:
                        grad_norms.append(gn)
        sums.all_reduce(self._all_reduce_)
        mismatch.all_reduce(self._all_reduce_, self._all_reduce_max_)
        # `step` last: a reader polling it (the Status RPC thread) then sees the rest updated.
        self.record_trained([i.group_id for i in infos])
        self.state.groups_trained += len(infos)
        self.state.policy_version += 1
        self.state.step += 1

        terms = sums.terms.item()
        tok = max(terms["tokens"], 1.0)  # optimised tokens run through the model
        n_all = max(terms["tokens"] + sums.skipped_tokens, 1.0)  # N: run + skipped (Â = 0)
        rewards = torch.cat([i.rewards_G for i in infos])
        valid = rewards[~torch.isnan(rewards)]
        adv = torch.tensor([r.advantage for r in rollouts])
        stale = torch.tensor([float(version_at_training - r.policy_version) for r in rollouts])
        metrics = {
            **counts,
            "loss": (terms["pg_sum"] + g.beta * terms["kl_sum"]) / n_all,
            "pg_loss": terms["pg_sum"] / n_all,
            "kl": terms["kl_sum"] / n_all,
            "clip_fraction": terms["clipped_tokens"] / n_all,
            "ratio_mean": terms["ratio_sum"] / tok,
            "entropy": sums.entropy / tok,
            "grad_norm": float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0,
            "lr": float(self.scheduler.get_last_lr()[0]),
            "reward_mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward_std": float(valid.std(unbiased=False)) if valid.numel() else float("nan"),
            "reward_nan": float(torch.isnan(rewards).sum()),
            "unscored": float(torch.isnan(rewards).sum()),  # evaluation raised: advantage 0, out of mean/std
            "adv_mean": float(adv.mean()),
            "adv_std": float(adv.std(unbiased=False)),
            "adv_min": float(adv.min()),
            "adv_max": float(adv.max()),
            "adv_zero_fraction": float((adv == 0).float().mean()),
            "staleness_mean": float(stale.mean()),
            "staleness_max": float(stale.max()),
            "rollouts": float(n),
            "optimised_tokens": (terms["tokens"] + sums.skipped_tokens) / g.ppo_epochs,
            "skipped_rollouts": sums.skipped_rollouts / g.ppo_epochs,
            "skipped_tokens": sums.skipped_tokens / g.ppo_epochs,
            "skipped_positions": sums.skipped_positions / g.ppo_epochs,
            "optimizer_steps": float(len(grad_norms)),
            "positions_trained": sums.positions,
            "positions_computed": sums.positions_computed,
            "shared_prefix_rows": sums.shared_prefix_rows,
            "shared_prefix_fallback_groups": sums.shared_prefix_fallback_groups,
            "shared_prefix_positions": sums.shared_prefix_positions,
            "logprob_mismatch_mean": mismatch.mean,
            "logprob_mismatch_max": mismatch.max,
            "nonfinite_grad_steps": float(self.skipped_nonfinite),
            **(extra_metrics or {}),
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
        self,
        rollouts: list[Rollout],
        mb: list[int],
        ref: list[torch.Tensor] | None,
        sums: StepTotals,
        mismatch: LogprobMismatch | None = None,
    ) -> float | None:
        """Forward/backward over this rank's share of mini-batch `mb`, then one AdamW step."""
        g = self.cfg.grpo
        shares = [shard_for_rank(mb, rollouts, r, self.world) for r in range(self.world)]
        mine = shares[self.rank]
        n_local = torch.tensor([float(sum(int(rollouts[i].mask_T.sum()) for i in mine))], dtype=torch.float64)
        self._all_reduce_(n_local)  # N = Σ_i T_i over the global mini-batch
        n_tokens = n_local.item()
        if n_tokens == 0:
            return None
        if self._skips_zero_advantage:
            # exact (β = 0): a rollout with Â = 0 adds exactly 0 to the loss and every gradient;
            # its tokens are in N above. The filter is the same on every rank (same mb).
            skipped = [i for i in mine if rollouts[i].advantage == 0.0]
            sums.skipped_rollouts += len(skipped)
            sums.skipped_tokens += float(sum(int(rollouts[i].mask_T.sum()) for i in skipped))
            sums.skipped_positions += float(sum(rollouts[i].num_positions for i in skipped))
            mb = [i for i in mb if rollouts[i].advantage != 0.0]
        units, stats = self._micro_batches(rollouts, mb)
        sums.add_layout(stats)
        for unit in units:
            pb = self._picked(rollouts, unit)
            logp_RT, ent_RT = self._forward_picks(self.model, pb, entropy=True)
            ref_RT = None
            if ref is not None:
                ref_RT = torch.zeros_like(pb.old_logp_RT)
                for i, row, start in pb.segments:
                    ref_RT[row, start : start + rollouts[i].num_positions] = ref[i].to(self.device)
            loss, terms = grpo_loss(
                logp_RT, pb.old_logp_RT, pb.adv_RT, pb.mask_RT, n_tokens, g.clip_eps_low, g.clip_eps_high, ref_RT, g.beta
            )
            loss.backward()
            positions = sum(rollouts[i].num_positions for i, _, _ in pb.segments)
            with torch.no_grad():
                m = pb.mask_RT
                if mismatch is not None and bool(m.any()):
                    mismatch.add((logp_RT.detach().double() - pb.old_logp_RT.double()).abs()[m])
                sums.add_terms(terms, ent_RT[m].sum().item(), positions, pb.positions_computed)
            del logp_RT, ent_RT, loss
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

    def _all_reduce_(self, t: torch.Tensor, op=None) -> None:
        """In-place sum (or `op`) over ranks of a CPU tensor (moved to the GPU and back for NCCL)."""
        if self.world == 1:
            return
        x = t.to(self.device) if dist.get_backend() == "nccl" else t
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op is None else op)
        if x is not t:
            t.copy_(x.cpu())

    def _all_reduce_max_(self, t: torch.Tensor) -> None:
        """In-place max over ranks of a CPU tensor."""
        self._all_reduce_(t, dist.ReduceOp.MAX)

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
