"""Re-scoring trajectories with transformers: the engine/trainer log-prob mismatch.

The learner computes log pi_old from the engine's log-probs; if the trainer's forward
(transformers) disagrees with the engine (kernels, dtype), the GRPO ratio is biased. This
module recomputes, for each generated token, log softmax(logits / T)[token] with a
transformers model on the trajectory's exact ids and compares with `Trajectory.logprobs`
per turn. Valid for top_p = 1 and no top-k (otherwise the engine's distribution is the
truncated, renormalised one).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from sinkflex.api.common.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnMismatch:
    """|engine log-prob - transformers log-prob| over one turn's generated tokens (nats)."""

    turn: int
    num_tokens: int
    mean_abs: float
    max_abs: float


@torch.no_grad()
def rescore(model, traj: common_pb2.Trajectory, temperature: float) -> torch.Tensor:
    """log pi(token_t | ids_<t) under softmax(logits / temperature) for every position t >= 1.

    Returns:
        logp_T: [T] float32; logp_T[0] = 0 (no context), logp_T[t] for the token at t.
    """
    ids_T = torch.tensor(list(traj.token_ids), dtype=torch.long)
    logits_TV = model(input_ids=ids_T[None]).logits[0].float()  # (T, V)
    logp_TV = torch.log_softmax(logits_TV[:-1] / max(temperature, 1e-6), dim=-1)  # predicts t = 1..T-1
    out_T = torch.zeros(len(ids_T), dtype=torch.float32)
    out_T[1:] = logp_TV.gather(1, ids_T[1:, None])[:, 0]
    return out_T


@torch.no_grad()
def rescore_group(model, trajs: list[common_pb2.Trajectory], temperature: float) -> list[torch.Tensor]:
    """`rescore` for the trajectories of a group, computing their shared prompt prefix once.

    The G trajectories of a task usually start with the same prompt (thousands of tokens
    for tau2 retail): its KV cache is computed once and copied for each trajectory's tail.
    Logits are computed only where a token is scored.

    Returns:
        one logp_T ([T] float32, 0 at t = 0) per trajectory.
    """

    if not trajs:
        return []
    seqs = [list(t.token_ids) for t in trajs]
    first_gen = min((t.turns[0].generation_start for t in trajs if t.turns), default=min(map(len, seqs)))
    p = 0
    while p < first_gen - 1 and all(len(s) > p and s[p] == seqs[0][p] for s in seqs):
        p += 1
    body, head = model.model, model.lm_head
    prefix = body(input_ids=torch.tensor(seqs[0][:p])[None], use_cache=True)  # shared prompt, once
    last_h = prefix.last_hidden_state[0, -1:]  # (1, D): predicts token p
    out = []
    for s in seqs:
        ids_T = torch.tensor(s, dtype=torch.long)
        tail = body(input_ids=ids_T[None, p:], past_key_values=copy.deepcopy(prefix.past_key_values), use_cache=True)
        h_RD = torch.cat([last_h, tail.last_hidden_state[0, :-1]])  # (T - p, D): predicts tokens p..T-1
        logp_RV = torch.log_softmax(head(h_RD).float() / max(temperature, 1e-6), dim=-1)
        logp_T = torch.zeros(len(s), dtype=torch.float32)
        logp_T[p:] = logp_RV.gather(1, ids_T[p:, None])[:, 0]
        out.append(logp_T)
    return out


def turn_mismatch(model, traj: common_pb2.Trajectory, temperature: float,
                  ref_T: torch.Tensor | None = None) -> list[TurnMismatch]:
    """Per-turn mismatch between `traj.logprobs` (engine) and a transformers re-score.

    `ref_T` ([T]) is a precomputed re-score (e.g. from `rescore_group`); None: `rescore`.
    Also logs it (logger `rollout_service.rescore`, one line per turn) and stores
    ``logprob_mismatch_turn{k}`` / ``logprob_mismatch_max`` in `traj.metrics`.
    """
    if ref_T is None:
        ref_T = rescore(model, traj, temperature)
    eng_T = torch.tensor(list(traj.logprobs), dtype=torch.float32)
    out = []
    for k, t in enumerate(traj.turns):
        s, e = t.generation_start, t.generation_start + t.num_generated
        if e <= s:
            continue
        diff = (eng_T[s:e] - ref_T[s:e]).abs()
        m = TurnMismatch(k, e - s, float(diff.mean()), float(diff.max()))
        out.append(m)
        traj.metrics[f"logprob_mismatch_turn{k}"] = m.mean_abs
        log.info("trajectory %s turn %d: logprob mismatch mean %.2e max %.2e over %d tokens",
                 traj.trajectory_id, k, m.mean_abs, m.max_abs, m.num_tokens)
    if out:
        traj.metrics["logprob_mismatch_max"] = max(m.max_abs for m in out)
    return out
