"""From `TrajectoryGroup` protos to padded training tensors.

The protos are converted here, at the edge, into frozen dataclasses; nothing past this
module reads a proto. A trajectory of T tokens gives T − 1 predicted positions: the
model reads token_ids[:-1] and position t predicts token_ids[t+1], whose old log-prob
(`logprobs[t+1]`) and loss mask (`loss_mask[t+1]`) come along. Rows are right-padded,
so with causal attention the padding never influences a real token and no attention
mask is needed (the sink path stays O(n)); padded positions have mask 0.

Legend: B = rollouts, T = predicted positions (padded), G = rollouts in a group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from learner_service.advantage import group_advantages
from sinkflex.api.common.v1 import common_pb2


@dataclass(frozen=True)
class Rollout:
    """One trajectory, ready to train on."""

    group_id: str
    trajectory_id: str
    token_ids_T: torch.Tensor  # [T+1] int64: every token of the episode
    old_logp_T: torch.Tensor  # [T] float32: engine log-prob of token t+1 (0 where not generated)
    mask_T: torch.Tensor  # [T] bool: token t+1 is optimised
    reward: float  # NaN: unscored
    advantage: float  # Â_i, eq. (3)
    policy_version: int  # version that sampled it
    truncated_tokens: int  # tokens cut by batch.max_seq_len

    @property
    def num_positions(self) -> int:
        return int(self.old_logp_T.numel())


@dataclass(frozen=True)
class GroupInfo:
    """Per-group bookkeeping for metrics and data accounting."""

    group_id: str
    rewards_G: torch.Tensor  # [G] float32
    adv_G: torch.Tensor  # [G] float32
    zero_variance: bool


@dataclass(frozen=True)
class TrainBatch:
    """Tensors of one micro-batch: right-padded rows, or packed rows (several rollouts per row)."""

    input_ids_BT: torch.Tensor  # [B, T] int64: token_ids[:-1], padded
    target_ids_BT: torch.Tensor  # [B, T] int64: token_ids[1:], padded
    old_logp_BT: torch.Tensor  # [B, T] float32
    mask_BT: torch.Tensor  # [B, T] bool
    adv_BT: torch.Tensor  # [B, T] float32: Â of the rollout at each position (eq. 4)
    segments: tuple[tuple[int, int, int], ...]  # (rollout index, row, start) of each rollout
    position_ids_BT: torch.Tensor | None = None  # [B, T] int64, packed rows only (restart per rollout)
    doc_ids_BT: torch.Tensor | None = None  # [B, T] int64, packed rows only (-1: padding)

    def to(self, device: torch.device | str) -> "TrainBatch":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return TrainBatch(
            mv(self.input_ids_BT), mv(self.target_ids_BT), mv(self.old_logp_BT), mv(self.mask_BT), mv(self.adv_BT),
            self.segments, mv(self.position_ids_BT), mv(self.doc_ids_BT),
        )


def rollouts_from_group(
    group: common_pb2.TrajectoryGroup, adv_eps: float = 1e-6, max_seq_len: int | None = None
) -> tuple[list[Rollout], GroupInfo]:
    """Converts one group and computes its advantages (eq. (3)).

    Args:
        group: a TrajectoryGroup proto; each trajectory needs len(token_ids) ==
            len(logprobs) == len(loss_mask) ≥ 2 and loss_mask[0] == 0.
        adv_eps: ε_A.
        max_seq_len: cut trajectories to this many tokens (None: no cut).

    Returns:
        (rollouts, info): one Rollout per trajectory, in order.

    Raises:
        ValueError: a trajectory with mismatched lengths, fewer than 2 tokens, a loss mask
            on the first token, a mask value other than 0/1, or non-finite engine log-probs
            on masked tokens; no trajectories.
    """
    if len(group.trajectories) == 0:
        raise ValueError(f"group {group.group_id!r} has no trajectories")
    rewards = []
    for i, tr in enumerate(group.trajectories):
        n, nl, nm = len(tr.token_ids), len(tr.logprobs), len(tr.loss_mask)
        where = f"group {group.group_id!r} trajectory {i} ({tr.trajectory_id!r})"
        if not (n == nl == nm):
            raise ValueError(f"{where}: token_ids {n}, logprobs {nl}, loss_mask {nm} differ in length")
        if n < 2:
            raise ValueError(f"{where}: needs at least 2 tokens, has {n}")
        if tr.loss_mask[0] != 0:
            raise ValueError(f"{where}: loss_mask[0] must be 0 (the first token has no log-prob)")
        if any(m not in (0, 1) for m in tr.loss_mask):
            raise ValueError(f"{where}: loss_mask values must be 0 or 1")
        rewards.append(tr.reward)
    rewards_G = torch.tensor(rewards, dtype=torch.float32)
    adv_G = group_advantages(rewards_G, adv_eps)
    rollouts = []
    for i, tr in enumerate(group.trajectories):
        ids = torch.tensor(list(tr.token_ids), dtype=torch.int64)
        logp = torch.tensor(list(tr.logprobs), dtype=torch.float32)
        mask = torch.tensor(list(tr.loss_mask), dtype=torch.bool)
        cut = 0
        if max_seq_len is not None and ids.numel() > max_seq_len:
            cut = int(ids.numel() - max_seq_len)
            ids, logp, mask = ids[:max_seq_len], logp[:max_seq_len], mask[:max_seq_len]
        if not torch.isfinite(logp[mask]).all():
            raise ValueError(f"group {group.group_id!r} trajectory {i}: non-finite logprobs on loss-mask tokens")
        rollouts.append(
            Rollout(
                group_id=group.group_id,
                trajectory_id=tr.trajectory_id,
                token_ids_T=ids,
                old_logp_T=logp[1:],
                mask_T=mask[1:],
                reward=float(tr.reward),
                advantage=float(adv_G[i]),
                policy_version=int(tr.policy_version),
                truncated_tokens=cut,
            )
        )
    zero_var = bool((adv_G == 0).all())
    return rollouts, GroupInfo(group.group_id, rewards_G, adv_G, zero_var)


def pack(rollouts: list[Rollout], indices: list[int], pad_token_id: int = 0, row_tokens: int | None = None) -> TrainBatch:
    """The rollouts `indices` of `rollouts` as one micro-batch.

    row_tokens None: one rollout per row, right-padded to the longest. row_tokens = L:
    rollouts are packed first-fit-decreasing into rows of at most L positions (a longer
    rollout gets a row of its own), with position ids restarting at 0 for each rollout and
    document ids so that the attention keeps rollouts apart (`sinkflex.attention`'s
    document mask).

    An empty `indices` gives a one-row dummy batch with an all-zero mask: a rank with no
    data for a micro-step still runs forward/backward so that the FSDP collectives of
    all ranks match (its gradient contribution is exactly 0).
    """
    if not indices:
        ids = torch.full((1, 1), pad_token_id, dtype=torch.int64)
        zero = torch.zeros(1, 1)
        return TrainBatch(ids, ids.clone(), zero, torch.zeros(1, 1, dtype=torch.bool), zero.clone(), ())
    rows: list[list[int]] = []
    if row_tokens is None:
        rows = [[i] for i in indices]
    else:
        fill: list[int] = []
        for i in sorted(indices, key=lambda i: (-rollouts[i].num_positions, i)):
            n = rollouts[i].num_positions
            r = next((k for k, used in enumerate(fill) if used + n <= row_tokens), None)
            if r is None:
                rows.append([i])
                fill.append(n)
            else:
                rows[r].append(i)
                fill[r] += n
    T = max(sum(rollouts[i].num_positions for i in row) for row in rows)
    B = len(rows)
    input_ids_BT = torch.full((B, T), pad_token_id, dtype=torch.int64)
    target_ids_BT = torch.full((B, T), pad_token_id, dtype=torch.int64)
    old_logp_BT = torch.zeros(B, T)
    mask_BT = torch.zeros(B, T, dtype=torch.bool)
    adv_BT = torch.zeros(B, T)
    pos_BT = torch.zeros(B, T, dtype=torch.int64)
    doc_BT = torch.full((B, T), -1, dtype=torch.int64)
    segments = []
    for b, row in enumerate(rows):
        start = 0
        for d, i in enumerate(row):
            r, n = rollouts[i], rollouts[i].num_positions
            sl = slice(start, start + n)
            input_ids_BT[b, sl] = r.token_ids_T[:-1]
            target_ids_BT[b, sl] = r.token_ids_T[1:]
            old_logp_BT[b, sl] = r.old_logp_T
            mask_BT[b, sl] = r.mask_T
            adv_BT[b, sl] = r.advantage
            pos_BT[b, sl] = torch.arange(n)
            doc_BT[b, sl] = d
            segments.append((i, b, start))
            start += n
    if row_tokens is None:
        return TrainBatch(input_ids_BT, target_ids_BT, old_logp_BT, mask_BT, adv_BT, tuple(segments))
    return TrainBatch(input_ids_BT, target_ids_BT, old_logp_BT, mask_BT, adv_BT, tuple(segments), pos_BT, doc_BT)


def shard_for_rank(indices: list[int], rollouts: list[Rollout], rank: int, world: int) -> list[int]:
    """This rank's share of a mini-batch: greedy token balancing, longest first, deterministic."""
    load = [0] * world
    mine: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(indices, key=lambda i: (-rollouts[i].num_positions, i)):
        r = min(range(world), key=lambda k: (load[k], k))
        mine[r].append(i)
        load[r] += rollouts[i].num_positions
    return sorted(mine[rank], key=lambda i: -rollouts[i].num_positions)


def micro_batches(indices: list[int], size: int, count: int) -> list[list[int]]:
    """Splits `indices` into exactly `count` micro-batches of at most `size` (empty ones at the end)."""
    out = [indices[s : s + size] for s in range(0, len(indices), size)]
    assert len(out) <= count, (len(out), count)
    return out + [[] for _ in range(count - len(out))]


def num_micro_steps(n: int, size: int) -> int:
    """Micro-batches needed for n rollouts (at least 1)."""
    return max(1, math.ceil(n / size))
