"""Warm start: supervised fine-tuning on demonstrations, before GRPO.

RL from a raw small instruct model on τ²-Bench never gets a reward (every group has zero
variance, every advantage is 0). Public τ²-Bench recipes therefore start from a supervised
warm start (slime: SFT → rejection fine-tuning → GRPO). Here the demonstrations are the
train split's golden actions played through the env service by a scripted policy and
rendered to token ids by the rollout service's own agent loop and formatter
(`sinkflex_rl.warm_start`), so a demonstration is byte-for-byte a trajectory the rollout
service could have produced: same chat template, tool format and loss mask. Only
demonstrations that τ²-Bench's checker scores 1.0 are kept (rejection sampling of the
scripted policy).

The objective is masked token-level cross-entropy (negative log-likelihood) on the
loss-mask tokens — the agent's own tokens, never the prompt or the environment's replies:

    L_SFT = −(1/N) Σ_i Σ_t m_{i,t} log π_θ(y_{i,t} | y_{i,<t}),     N = Σ_i Σ_t m_{i,t}

with N counted over the global batch of one optimiser step (all micro-batches, all ranks),
exactly as the GRPO loss normalises (learner_service/loss.py), so micro-batching and FSDP
give the exact full-batch gradient. Log-probs are at temperature 1 (the model's own
distribution), in float32, computed only at the loss-mask positions
(`learner_service.logprobs.picked_logprobs`); demonstrations sharing a prompt prefix are
packed into one shared-prefix row, as the learner packs a GRPO group.

It runs on the learner itself (same model, FSDP2 sharding, attention path and packing as
GRPO) with its own AdamW (the GRPO optimiser's moments are not touched), and ends by
publishing the result as the next policy version: the version RL starts from.

File format of the demonstrations: a sequence of length-delimited `TrajectoryGroup`
protobufs (varint length, then the message — protobuf's standard delimited framing), one
group per task.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from google.protobuf.internal.decoder import _DecodeVarint
from google.protobuf.internal.encoder import _VarintBytes
from tqdm.auto import tqdm

from learner_service.batch import Rollout, rollouts_from_group
from learner_service.logprobs import rollout_logprobs
from sinkflex.api.common.v1 import common_pb2

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ the file of demonstrations
def write_demonstrations(path: str | Path, groups: Iterable[common_pb2.TrajectoryGroup]) -> int:
    """Writes `groups` as length-delimited protobufs (atomically: tmp file + rename). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    n = 0
    with tmp.open("wb") as f:
        for g in groups:
            data = g.SerializeToString()
            f.write(_VarintBytes(len(data)))
            f.write(data)
            n += 1
    tmp.replace(path)
    return n


def read_demonstrations(path: str | Path) -> list[common_pb2.TrajectoryGroup]:
    """Reads a file written by `write_demonstrations`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is truncated or not length-delimited TrajectoryGroups.
    """
    data = Path(path).read_bytes()
    out, pos = [], 0
    while pos < len(data):
        try:
            size, pos = _DecodeVarint(data, pos)
        except IndexError:
            raise ValueError(f"{path}: truncated length prefix at byte {pos}") from None
        if pos + size > len(data):
            raise ValueError(f"{path}: truncated message at byte {pos} ({size} bytes announced, {len(data) - pos} left)")
        try:
            out.append(common_pb2.TrajectoryGroup.FromString(data[pos : pos + size]))
        except Exception as err:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise ValueError(f"{path}: message at byte {pos} is not a TrajectoryGroup: {err}") from None
        pos += size
    return out


# ------------------------------------------------------------------ the loss
def sft_loss(logp_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked negative log-likelihood of one (micro-)batch (the module docstring's L_SFT).

    Args:
        logp_BT: [B, T] float, log π_θ of each target token (differentiable).
        mask_BT: [B, T] bool/0-1, the loss mask (the agent's tokens).
        num_tokens: N, the optimised-token count of the whole optimiser step (> 0).

    Returns:
        (loss, nll_sum): loss = −Σ mask·logp / N, a [] tensor; nll_sum the detached Σ −mask·logp.

    Raises:
        ValueError: shapes differ or num_tokens <= 0.
    """
    if logp_BT.shape != mask_BT.shape:
        raise ValueError(f"logp_BT {tuple(logp_BT.shape)} and mask_BT {tuple(mask_BT.shape)} must have the same shape [B, T]")
    if not num_tokens > 0:
        raise ValueError(f"num_tokens must be > 0, got {num_tokens}")
    m_BT = mask_BT.bool()
    logp_BT = logp_BT.to(torch.promote_types(logp_BT.dtype, torch.float32))  # float32, or float64 as given
    nll_BT = torch.where(m_BT, -logp_BT, torch.zeros_like(logp_BT))
    nll_sum = nll_BT.sum()
    return nll_sum / num_tokens, nll_sum.detach()


# ------------------------------------------------------------------ the warm start
#: The group id every demonstration is trained under (see `demonstration_rollouts`).
DEMONSTRATIONS_GROUP = "warm-start-demonstrations"


def demonstration_rollouts(groups: Sequence[common_pb2.TrajectoryGroup], max_seq_len: int | None = None) -> list[Rollout]:
    """The trajectories of `groups` as typed rollouts (rewards and advantages unused).

    Raises:
        ValueError: a malformed trajectory (see batch.rollouts_from_group), or no loss-mask token at all.
    """
    # one group id for all: the learner packs rollouts of a group that share a prompt prefix into
    # one shared-prefix row, and demonstrations of one domain share their tool block and policy
    rollouts = [dataclasses.replace(r, group_id=DEMONSTRATIONS_GROUP)
                for g in groups for r in rollouts_from_group(g, max_seq_len=max_seq_len)[0]]
    if not rollouts or not any(bool(r.mask_T.any()) for r in rollouts):
        raise ValueError("the demonstrations hold no loss-mask token to train on")
    return rollouts


def warm_start(learner, groups: Sequence[common_pb2.TrajectoryGroup]) -> dict[str, float]:
    """Masked cross-entropy on `groups` for `cfg.warm_start.epochs` epochs; then policy_version += 1.

    Every rank must call it with the same groups (as `Learner.train_step`). Writes one
    "warm_start" metrics record per optimiser step (loss = mean NLL per token, token
    accuracy of the argmax, grad norm) and returns the last epoch's means.

    Args:
        learner: a `learner_service.trainer.Learner`.
        groups: the demonstrations (`read_demonstrations`).

    Raises:
        ValueError: no trainable token in `groups`.
    """
    cfg, w = learner.cfg, learner.cfg.warm_start
    rollouts = demonstration_rollouts(groups, cfg.batch.max_seq_len)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=w.lr, betas=cfg.optim.betas, eps=w.eps, weight_decay=w.weight_decay)
    gen = torch.Generator().manual_seed(cfg.model.seed + 1)
    n = len(rollouts)
    steps_per_epoch = max(1, math.ceil(n / w.batch_size))
    total = steps_per_epoch * w.epochs
    t0 = time.perf_counter()
    step = 0
    last: dict[str, float] = {}
    log.info("warm start: %d demonstrations, %d epochs, %d optimiser steps, lr %g", n, w.epochs, total, w.lr)
    bar = tqdm(total=total, desc="warm start", unit="step", disable=learner.rank != 0, mininterval=5.0)
    for epoch in range(w.epochs):
        perm = torch.randperm(n, generator=gen).tolist()
        ep_nll = ep_tok = ep_hit = 0.0
        for k in range(steps_per_epoch):
            mb = perm[k * w.batch_size : (k + 1) * w.batch_size]
            lr = w.lr * min(1.0, (step + 1) / max(1, w.warmup_steps)) if w.warmup_steps else w.lr
            for group in opt.param_groups:
                group["lr"] = lr
            nll, tok, hit, gn = sft_step(learner, opt, rollouts, mb)
            step += 1
            ep_nll, ep_tok, ep_hit = ep_nll + nll, ep_tok + tok, ep_hit + hit
            rec = {"loss": nll / max(tok, 1.0), "token_accuracy": hit / max(tok, 1.0), "grad_norm": gn, "lr": lr,
                   "epoch": float(epoch + 1), "tokens": tok}
            if learner.writer is not None:
                learner.writer.write("warm_start", step, rec)
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", acc=f"{rec['token_accuracy']:.3f}")
        last = {"warm_start_loss": ep_nll / max(ep_tok, 1.0), "warm_start_token_accuracy": ep_hit / max(ep_tok, 1.0)}
        log.info("warm start epoch %d/%d: loss %.4f, token accuracy %.3f", epoch + 1, w.epochs,
                 last["warm_start_loss"], last["warm_start_token_accuracy"])
    bar.close()
    opt.zero_grad(set_to_none=True)
    del opt
    learner.state.policy_version += 1
    learner.state.warm_start_version = learner.state.policy_version
    learner.set_reference()  # the KL reference of RL is the policy RL starts from
    last.update({"warm_start_demonstrations": float(n), "warm_start_optimizer_steps": float(step),
                 "warm_start_seconds": time.perf_counter() - t0})
    learner.last_metrics = {**learner.last_metrics, **last, "policy_version": float(learner.state.policy_version)}
    return last


def sft_step(learner, opt, rollouts: list[Rollout], mb: list[int]) -> tuple[float, float, float, float]:
    """Forward/backward of this rank's share of `mb`, one step of `opt`. Returns (Σ nll, tokens, argmax hits, grad norm).

    The micro-batches are the learner's own (`Learner.micro_batches`): demonstrations that
    share a prompt prefix (every demonstration of a domain shares its tool block and policy)
    become one shared-prefix row, so the common prompt is computed once per micro-batch. The
    step is the learner's (`Learner.optimizer_step`: global norm clipped, non-finite skipped).
    """
    n_tokens = learner.global_tokens(rollouts, mb)  # N over the global mini-batch
    if n_tokens == 0:
        return 0.0, 0.0, 0.0, 0.0
    sums = torch.zeros(3, dtype=torch.float64)  # Σ nll, tokens, hits
    batches, _ = learner.micro_batches(rollouts, mb)
    for pb in batches:
        pb = pb.to(learner.device)
        logits_NV = learner.logits(learner.model, pb)
        logp_RT, _ = rollout_logprobs(logits_NV, pb, 1.0)  # the model's own distribution
        loss, nll_sum = sft_loss(logp_RT, pb.mask_RT, n_tokens)
        loss.backward()
        with torch.no_grad():
            hit_K = logits_NV[pb.pick_row_K].argmax(-1) == pb.pick_target_K
            hits = (hit_K[pb.src_RT] & pb.mask_RT).sum()
        sums += torch.tensor([nll_sum.item(), float(pb.mask_RT.sum()), float(hits)], dtype=torch.float64)
        del logits_NV, logp_RT, loss
    learner.all_reduce_(sums)
    gn = learner.optimizer_step(opt)
    return float(sums[0]), float(sums[1]), float(sums[2]), gn
