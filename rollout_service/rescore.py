"""Re-scoring trajectories with transformers: the engine/trainer log-prob mismatch.

The learner computes log pi_old from the engine's log-probs; if the trainer's forward
(transformers) disagrees with the engine (kernels, dtype), the GRPO ratio is biased. This
module recomputes, for each generated token, log softmax(logits / T)[token] with a
transformers model on the trajectory's exact ids and compares with `Trajectory.logprobs`
per turn. Valid for top_p = 1 and no top-k (otherwise the engine's distribution is the
truncated, renormalised one).
"""

from __future__ import annotations

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


def turn_mismatch(model, traj: common_pb2.Trajectory, temperature: float) -> list[TurnMismatch]:
    """Per-turn mismatch between `traj.logprobs` (engine) and a transformers re-score.

    Also logs it (logger `rollout_service.rescore`, one line per turn) and stores
    ``logprob_mismatch_turn{k}`` / ``logprob_mismatch_max`` in `traj.metrics`.
    """
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
