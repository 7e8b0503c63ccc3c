"""From `TrajectoryGroup` protos to padded training tensors.

The protos are converted here, at the edge, into frozen dataclasses; nothing past this
module reads a proto. Each group is converted exactly once (`Group.from_proto`, called by
the learner's loop where it reads the group from the buffer): bytes → proto in
`sinkflex.buffer` (`_decode`), proto → `Group` (rollouts, advantages) in
`loop.LearnerRunner._next_tick`, and that `Group` is what is broadcast to the other ranks
and trained on (`Group`'s docstring has the path). A trajectory of T tokens gives T − 1 predicted positions: the
model reads token_ids[:-1] and position t predicts token_ids[t+1], whose old log-prob
(`logprobs[t+1]`) and loss mask (`loss_mask[t+1]`) come along. Rows are right-padded,
so with causal attention the padding never influences a real token and no attention
mask is needed (the sink path stays O(n)); padded positions have mask 0.

Shared-prefix rows (`pack_shared`): the G rollouts of a group share their prompt, so a
group is packed as one row [prefix | suffix_1 | … | suffix_G] and the prefix is computed
once (`sinkflex.attention.generate_shared_prefix`: each suffix sees the prefix and its own
causal past; position ids continue from the prefix in every suffix). The loss still runs
per rollout: `PickedBatch` maps every rollout position to the logits row that predicts it
(`src_RT` → a pick (row, target)); the last prefix position is one row with G picks (each
suffix's first token). Only rows some loss-mask token needs get logits at all (`keep_J`).

Legend: B = rollouts (model rows for `TrainBatch`), T = predicted positions (padded),
G = rollouts in a group, N = packed positions of a model row, J = positions whose logits
are computed, K = (row, target) picks, R = rollouts of a `PickedBatch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from learner_service.advantage import group_advantages
from learner_service.shaping import shaped_reward
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


def group_policy_version(group: common_pb2.TrajectoryGroup) -> int:
    """The oldest policy version that sampled any turn of `group` (its trajectories'
    policy_version, and every turn's; 0 for a group without trajectories)."""
    versions = [t.policy_version for t in group.trajectories]
    versions += [turn.policy_version for t in group.trajectories for turn in t.turns]
    return min(versions, default=0)


@dataclass(frozen=True)
class Group:
    """One TrajectoryGroup, decoded once: what the learner broadcasts and trains on.

    Where a group is decoded (bytes → proto → typed), end to end:
    - `sinkflex.buffer.stream.TrajectoryBuffer.read` (`_decode`) parses the Redis entry's
      bytes into a `common_pb2.TrajectoryGroup` once (malformed payloads are dead-lettered
      there); `BufferEntry.group` is that proto, kept only for acknowledging the entry;
    - `loop.LearnerRunner._next_tick` (rank 0) turns each proto into a `Group` with
      `Group.from_proto`, right where it reads it: this validates it (a `ValueError` →
      acknowledged untrained and counted) and computes its advantages (eq. (3))
      with the learner's config (adv_eps, max_seq_len, reward shaping);
    - `loop.LearnerRunner._broadcast` sends these `Group`s (tensors, no proto) to the
      other ranks; `Learner.train_step` trains on them as they are.

    `train_step` also accepts protos (tests, benchmarks, the warm start's callers): those
    are converted once, in `Learner.prepare`.

    Attributes:
        group_id, task_id, env: the proto's.
        rollouts: one `Rollout` per trajectory, in order, advantages computed.
        info: rewards, advantages and zero-variance flag (`GroupInfo`).
        policy_version: the oldest policy version that sampled any of its turns
            (`group_policy_version`; the staleness check).
    """

    group_id: str
    task_id: str
    env: str
    rollouts: tuple[Rollout, ...]
    info: GroupInfo
    policy_version: int

    @classmethod
    def from_proto(
        cls, group: common_pb2.TrajectoryGroup, adv_eps: float = 1e-6, max_seq_len: int | None = None, shaping=None
    ) -> Group:
        """Converts one group and computes its advantages (eq. (3)).

        Args:
            group: a TrajectoryGroup proto; each trajectory needs len(token_ids) ==
                len(logprobs) == len(loss_mask) ≥ 2 and loss_mask[0] == 0.
            adv_eps: ε_A.
            max_seq_len: cut trajectories to this many tokens (None: no cut).
            shaping: a `RewardShapingConfig`: advantages from τ²-Bench's reward plus partial
                credit from its own checks (learner_service/shaping.py); None or α = 0: the
                trajectory reward as it is.

        Raises:
            ValueError: a trajectory with mismatched lengths, fewer than 2 tokens, a loss mask
                on the first token, a mask value other than 0/1, or non-finite engine log-probs
                on masked tokens; no trajectories.
        """
        rollouts, info = _convert(group, adv_eps, max_seq_len, shaping)
        return cls(group.group_id, group.task_id, group.env, tuple(rollouts), info, group_policy_version(group))


def validate_group(group: common_pb2.TrajectoryGroup, vocab_size: int) -> None:
    """Checks a group the learner has just read, before anything is computed from it.

    A group that fails is poison: training on it would raise inside the step (an embedding
    lookup past the vocabulary) or train on garbage, so the learner moves it to the
    dead-letter stream with the message of this error (learner_service/loop.py).

    Args:
        group: the TrajectoryGroup as read from the buffer.
        vocab_size: rows of the learner's input embedding; every token id must be in
            [0, vocab_size).

    Raises:
        ValueError: no trajectories; a trajectory whose token_ids, logprobs and loss_mask differ
            in length or that has fewer than 2 tokens; a token id outside the vocabulary; a
            loss-mask value other than 0/1 or a mask on the first token; a non-finite
            engine log-prob on a masked token; an infinite reward (NaN marks an unscored
            rollout and is allowed). The message names the group, the trajectory and the
            first offending index and value.
    """
    if len(group.trajectories) == 0:
        raise ValueError(f"group {group.group_id!r} has no trajectories")
    for i, tr in enumerate(group.trajectories):
        where = f"group {group.group_id!r} trajectory {i} ({tr.trajectory_id[:80]!r})"
        n, nl, nm = len(tr.token_ids), len(tr.logprobs), len(tr.loss_mask)
        if not (n == nl == nm):
            raise ValueError(f"{where}: token_ids {n}, logprobs {nl}, loss_mask {nm} differ in length")
        if n < 2:
            raise ValueError(f"{where}: needs at least 2 tokens, has {n}")
        ids = torch.tensor(list(tr.token_ids), dtype=torch.int64)
        bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
        if bad.numel():
            k = int(bad[0])
            raise ValueError(f"{where}: token id {int(ids[k])} at {k} is outside the vocabulary [0, {vocab_size})")
        mask = torch.tensor(list(tr.loss_mask), dtype=torch.int64)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{where}: loss_mask values must be 0 or 1")
        if int(mask[0]) != 0:
            raise ValueError(f"{where}: loss_mask[0] must be 0 (the first token has no log-prob)")
        logp = torch.tensor(list(tr.logprobs), dtype=torch.float32)
        bad = (~torch.isfinite(logp) & (mask == 1)).nonzero()
        if bad.numel():
            k = int(bad[0])
            raise ValueError(f"{where}: log-prob {float(logp[k])} at {k} (a loss-mask token) is not finite")
        if math.isinf(tr.reward):
            raise ValueError(f"{where}: reward {tr.reward} is infinite")


def rollouts_from_group(
    group: common_pb2.TrajectoryGroup, adv_eps: float = 1e-6, max_seq_len: int | None = None, shaping=None
) -> tuple[list[Rollout], GroupInfo]:
    """(rollouts, info) of one group: `Group.from_proto`'s, as a list and its `GroupInfo`.

    Raises:
        ValueError: a malformed group (see `Group.from_proto`).
    """
    g = Group.from_proto(group, adv_eps, max_seq_len, shaping)
    return list(g.rollouts), g.info


def _convert(
    group: common_pb2.TrajectoryGroup, adv_eps: float, max_seq_len: int | None, shaping
) -> tuple[list[Rollout], GroupInfo]:
    """`Group.from_proto`'s conversion and validation (its docstring)."""
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
        rewards.append(tr.reward if shaping is None else shaped_reward(tr.reward, tr.reward_breakdown, shaping))
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


@dataclass(frozen=True)
class PickedBatch:
    """One micro-batch as the learner's forward sees it: model rows, kept logits, picks, rollout-space targets.

    Built by `picks_from_batch` (unshared / document-packed rows) or `pack_shared` (a
    shared-prefix row). The model reads ``input_ids_BN`` and computes logits only at the
    columns ``keep_J`` (transformers ``logits_to_keep``), giving ``[B, J, V]``, flattened to
    ``[B·J, V]`` rows; pick k is (row ``pick_row_K[k]``, target ``pick_target_K[k]``); rollout r's
    position t reads pick ``src_RT[r, t]`` (only where ``mask_RT``).
    """

    input_ids_BN: torch.Tensor  # [B, N] int64
    position_ids_BN: torch.Tensor | None  # [B, N] int64 (packed or shared rows), None: 0..N-1
    doc_ids_BN: torch.Tensor | None  # [B, N] int64 document ids (packed rows), else None
    segment_ids_BN: torch.Tensor | None  # [B, N] int64 shared-prefix segments (0 prefix, s ≥ 1 suffix), else None
    keep_J: torch.Tensor  # [J] int64 columns whose logits are computed
    pick_row_K: torch.Tensor  # [K] int64 into the B·J flattened logits rows
    pick_target_K: torch.Tensor  # [K] int64 token ids
    src_RT: torch.Tensor  # [R, T] int64 into K (0 where mask_RT is 0)
    target_ids_RT: torch.Tensor  # [R, T] int64
    old_logp_RT: torch.Tensor  # [R, T] float32
    mask_RT: torch.Tensor  # [R, T] bool
    adv_RT: torch.Tensor  # [R, T] float32
    segments: tuple[tuple[int, int, int], ...]  # (rollout index, r, 0): rollout-space rows start at 0
    prefix_len: int = 0  # shared positions (0: not a shared row)
    positions_computed: int = 0  # model positions of the forward (without padding)

    def to(self, device: torch.device | str) -> "PickedBatch":
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        return PickedBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})


def picks_from_batch(b: TrainBatch, rollouts: list[Rollout]) -> PickedBatch:
    """The `PickedBatch` of an unshared (padded or document-packed) `TrainBatch`.

    Rollout space: one row per rollout (R = number of rollouts, right-padded), the same
    per-position tensors as the padded `pack`; logits only at columns some row needs.
    """
    seg_of = {i: (row, start) for i, row, start in b.segments}
    order = [i for i, _, _ in b.segments]
    R = max(len(order), 1)
    T = max((rollouts[i].num_positions for i in order), default=1)
    tgt_RT = torch.zeros(R, T, dtype=torch.int64)
    old_RT = torch.zeros(R, T)
    mask_RT = torch.zeros(R, T, dtype=torch.bool)
    adv_RT = torch.zeros(R, T)
    for r, i in enumerate(order):
        row, start = seg_of[i]
        n = rollouts[i].num_positions
        sl = slice(start, start + n)
        tgt_RT[r, :n] = b.target_ids_BT[row, sl]
        old_RT[r, :n] = b.old_logp_BT[row, sl]
        mask_RT[r, :n] = b.mask_BT[row, sl]
        adv_RT[r, :n] = b.adv_BT[row, sl]
    keep_J = b.mask_BT.any(0).nonzero().flatten()
    if keep_J.numel() == 0:
        keep_J = torch.zeros(1, dtype=torch.int64)  # the forward still runs (FSDP collectives)
    B, J = b.input_ids_BT.shape[0], keep_J.numel()
    col_of = torch.full((b.input_ids_BT.shape[1],), -1, dtype=torch.int64)
    col_of[keep_J] = torch.arange(J)
    rows = (torch.arange(B)[:, None] * J + torch.arange(J)[None, :]).flatten()  # [B·J]: every kept row
    targets = b.target_ids_BT[:, keep_J].flatten()
    src_RT = torch.zeros(R, T, dtype=torch.int64)
    for r, i in enumerate(order):
        row, start = seg_of[i]
        n = rollouts[i].num_positions
        cols = col_of[start : start + n]
        src_RT[r, :n] = torch.where(cols >= 0, row * J + cols, torch.zeros_like(cols))
    positions = sum(rollouts[i].num_positions for i in order)
    return PickedBatch(
        b.input_ids_BT, b.position_ids_BT, b.doc_ids_BT, None, keep_J, rows, targets, src_RT,
        tgt_RT, old_RT, mask_RT, adv_RT, tuple((i, r, 0) for r, i in enumerate(order)), 0, positions,
    )


def common_prefix_len(rollouts: list[Rollout], indices: list[int]) -> int:
    """P: the longest common prefix of the rollouts' token ids, capped so that every rollout
    keeps its last input (P ≤ T_i + 1 − 1 = number of positions of the shortest)."""
    ids = [rollouts[i].token_ids_T for i in indices]
    cap = min(int(t.numel()) - 1 for t in ids)
    first = ids[0][:cap]
    p = cap
    for t in ids[1:]:
        diff = (t[:cap] != first).nonzero()
        if diff.numel():
            p = min(p, int(diff[0]))
    return p


def shared_prefix_pays(rollouts: list[Rollout], indices: list[int], min_prefix: int = 1) -> bool:
    """Whether `pack_shared` shares these rollouts: at least 2, common prefix ≥ min_prefix (and ≥ 1)."""
    return len(indices) >= 2 and common_prefix_len(rollouts, indices) >= max(min_prefix, 1)


def pack_shared(rollouts: list[Rollout], indices: list[int], min_prefix: int = 1) -> PickedBatch | None:
    """One shared-prefix row [prefix | suffix_1 | … | suffix_G] for rollouts of one group.

    The prefix is the longest common prefix P of the token ids (`common_prefix_len`); suffix
    i holds inputs token_ids[P : T_i] at positions P, P+1, … (as if alone). Logits row of
    prefix position t < P−1 predicts token t+1 for every rollout (one pick, shared); the row
    of position P−1 has one pick per rollout (its token P); suffix rows one pick each.
    Rollout-space tensors are exactly those of the unshared padded batch.

    Returns:
        the batch, or None when sharing does not pay (fewer than 2 rollouts, or P < min_prefix):
        the caller packs those rollouts unshared.
    """
    if len(indices) < 2:
        return None
    P = common_prefix_len(rollouts, indices)
    if P < max(min_prefix, 1):
        return None
    rs = [rollouts[i] for i in indices]
    n_suf = [r.num_positions - P for r in rs]  # suffix inputs (may be 0)
    N = P + sum(n_suf)
    inp = torch.empty(N, dtype=torch.int64)
    pos = torch.empty(N, dtype=torch.int64)
    seg = torch.empty(N, dtype=torch.int64)
    inp[:P] = rs[0].token_ids_T[:P]
    pos[:P] = torch.arange(P)
    seg[:P] = 0
    starts = []
    a = P
    for s, (r, n) in enumerate(zip(rs, n_suf)):
        starts.append(a)
        inp[a : a + n] = r.token_ids_T[P : P + n]
        pos[a : a + n] = torch.arange(P, P + n)
        seg[a : a + n] = s + 1
        a += n
    R, T = len(rs), max(r.num_positions for r in rs)
    tgt_RT = torch.zeros(R, T, dtype=torch.int64)
    old_RT = torch.zeros(R, T)
    mask_RT = torch.zeros(R, T, dtype=torch.bool)
    adv_RT = torch.zeros(R, T)
    # packed column of rollout r's position t: t for t < P, starts[r] + t − P after
    col_RT = torch.zeros(R, T, dtype=torch.int64)
    for k, r in enumerate(rs):
        n = r.num_positions
        tgt_RT[k, :n] = r.token_ids_T[1:]
        old_RT[k, :n] = r.old_logp_T
        mask_RT[k, :n] = r.mask_T
        adv_RT[k, :n] = r.advantage
        col_RT[k, :P] = torch.arange(P)
        col_RT[k, P:n] = torch.arange(starts[k], starts[k] + n - P)
    need_N = torch.zeros(N, dtype=torch.bool)
    need_N[col_RT[mask_RT]] = True
    keep_J = need_N.nonzero().flatten()
    if keep_J.numel() == 0:
        keep_J = torch.zeros(1, dtype=torch.int64)
    J = keep_J.numel()
    j_of = torch.full((N,), -1, dtype=torch.int64)
    j_of[keep_J] = torch.arange(J)
    # picks: one per kept column (its own target for every column but P−1), plus G at P−1
    col_target = torch.zeros(N, dtype=torch.int64)
    col_target[: P - 1] = rs[0].token_ids_T[1:P]
    for k, r in enumerate(rs):
        n = r.num_positions
        col_target[starts[k] : starts[k] + n - P] = r.token_ids_T[P + 1 : n + 1]
    shared_cols = keep_J[keep_J != P - 1]
    pick_row = [j_of[shared_cols]]
    pick_tgt = [col_target[shared_cols]]
    pick_of_col = torch.zeros(N, dtype=torch.int64)
    pick_of_col[shared_cols] = torch.arange(shared_cols.numel())
    src_RT = torch.where(mask_RT, pick_of_col[col_RT], torch.zeros_like(col_RT))
    k0 = shared_cols.numel()
    if bool(need_N[P - 1]):
        boundary = mask_RT[:, P - 1]  # rollouts whose token P is optimised
        ks = boundary.nonzero().flatten()
        pick_row.append(torch.full((ks.numel(),), int(j_of[P - 1]), dtype=torch.int64))
        pick_tgt.append(tgt_RT[ks, P - 1])
        src_RT[ks, P - 1] = k0 + torch.arange(ks.numel())
    return PickedBatch(
        inp[None], pos[None], None, seg[None], keep_J, torch.cat(pick_row), torch.cat(pick_tgt), src_RT,
        tgt_RT, old_RT, mask_RT, adv_RT, tuple((i, k, 0) for k, i in enumerate(indices)), P, N,
    )


def shard_for_rank(indices: list[int], rollouts: list[Rollout], rank: int, world: int) -> list[int]:
    """This rank's share of a mini-batch: greedy token balancing, longest first, deterministic."""
    load = [0] * world
    mine: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(indices, key=lambda i: (-rollouts[i].num_positions, i)):
        r = min(range(world), key=lambda k: (load[k], k))
        mine[r].append(i)
        load[r] += rollouts[i].num_positions
    return sorted(mine[rank], key=lambda i: -rollouts[i].num_positions)


@dataclass(frozen=True)
class LayoutCounts:
    """How `plan_micro_batches` laid out this rank's rollouts (metrics)."""

    shared_prefix_rows: int = 0  # shared-prefix rows built
    shared_prefix_fallback_groups: int = 0  # chunks of ≥ 2 rollouts whose common prefix was too short to share
    shared_prefix_positions: int = 0  # Σ prefix length of the shared rows (positions computed once)


def plan_micro_batches(
    rollouts: list[Rollout],
    indices: list[int],
    *,
    rank: int,
    world: int,
    micro_batch_size: int,
    shared_prefix: bool,
    shared_prefix_across_groups: bool = False,
    shared_prefix_min_tokens: int = 1,
    pad_token_id: int = 0,
    pack_tokens: int | None = None,
) -> tuple[list[PickedBatch], LayoutCounts]:
    """Rank `rank`'s micro-batches of the rollouts `indices` (one mini-batch), on CPU.

    The mini-batch is shared out over the `world` ranks (`shard_for_rank`). With
    `shared_prefix`, a rank's rollouts are chunked by group (all in one chunk sequence with
    `shared_prefix_across_groups`) into chunks of at most `micro_batch_size`; a chunk whose
    common prefix is ≥ `shared_prefix_min_tokens` becomes one shared-prefix row
    (`pack_shared`), the others fall back to unshared rows. Unshared rollouts are sorted
    longest first and packed `micro_batch_size` at a time (`pack`, padded or packed into rows
    of `pack_tokens` positions) into `PickedBatch`es (`picks_from_batch`).

    Every rank gets the same number of micro-batches, at least one (FSDP's collectives run
    once per forward/backward on every rank): a rank with fewer is padded with dummy
    batches whose loss mask is all zero (`pack` of no rollout).

    Returns:
        (the shared rows first, then the unshared micro-batches; this rank's layout counts).
    """
    shares = [shard_for_rank(indices, rollouts, r, world) for r in range(world)]
    shared_rows_per_rank: list[int] = []
    unshared_per_rank: list[list[int]] = []
    mine: list[PickedBatch] = []
    counts = LayoutCounts()
    for r, share in enumerate(shares):
        chunks: list[list[int]] = []
        if shared_prefix:
            by_group: dict[str, list[int]] = {}
            for i in share:  # one "group" for all of them when the prefix is shared across groups
                by_group.setdefault("" if shared_prefix_across_groups else rollouts[i].group_id, []).append(i)
            chunks = [m[c : c + micro_batch_size] for m in by_group.values() for c in range(0, len(m), micro_batch_size)]
        pays = [shared_prefix_pays(rollouts, c, shared_prefix_min_tokens) for c in chunks]
        shared = [c for c, p in zip(chunks, pays) if p]
        fallback = [c for c, p in zip(chunks, pays) if not p]
        rest = [i for c in fallback for i in c] if shared_prefix else list(share)
        shared_rows_per_rank.append(len(shared))
        unshared_per_rank.append(sorted(rest, key=lambda i: -rollouts[i].num_positions))
        if r == rank:
            mine = [pack_shared(rollouts, c, shared_prefix_min_tokens) for c in shared]
            counts = LayoutCounts(
                shared_prefix_rows=len(mine),
                shared_prefix_fallback_groups=sum(len(c) > 1 for c in fallback),
                shared_prefix_positions=sum(pb.prefix_len for pb in mine),
            )
    # at least one micro-step per rank (FSDP collectives), no dummy after shared rows
    steps = max(1, max(sh + (num_micro_steps(len(rest), micro_batch_size) if rest else 0)
                       for sh, rest in zip(shared_rows_per_rank, unshared_per_rank)))
    for mb in micro_batches(unshared_per_rank[rank], micro_batch_size, steps - len(mine)):
        mine.append(picks_from_batch(pack(rollouts, mb, pad_token_id, pack_tokens), rollouts))
    return mine, counts


def micro_batches(indices: list[int], size: int, count: int) -> list[list[int]]:
    """Splits `indices` into exactly `count` micro-batches of at most `size` (empty ones at the end)."""
    out = [indices[s : s + size] for s in range(0, len(indices), size)]
    assert len(out) <= count, (len(out), count)
    return out + [[] for _ in range(count - len(out))]


def num_micro_steps(n: int, size: int) -> int:
    """Micro-batches needed for n rollouts (at least 1)."""
    return max(1, math.ceil(n / size))
