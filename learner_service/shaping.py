"""Optional shaped training reward: τ²-Bench's task reward plus partial credit from its own checks.

τ²-Bench's reward is all-or-nothing (the product of the checks in the task's reward basis),
so an episode that makes one of two required calls scores exactly as one that makes none.
Shaping adds partial credit computed only from τ²-Bench's per-check records, which the
reward service returns in each trajectory's `RewardBreakdown` (`details_json` of each
component, tau2's `RewardInfo` fields):

    partial = Σ_c w_c · share_c / Σ_c w_c        over the checks c present in the breakdown
    R_train = R_task + α · partial

with share_ACTION = the fraction of golden actions matched (`action_checks[*].action_match`),
share_ENV_ASSERTION = the fraction of environment assertions met (`env_assertions[*].met`),
share_COMMUNICATE = the fraction of communicate checks met (`communicate_checks[*].met`).
The default weights are slime's τ²-Bench recipe (0.5 action, 0.35 env assertions, 0.15
communicate). Off by default (α = 0). It changes only the reward the advantages are
computed from; validation always reports τ²-Bench's own reward.
"""

from __future__ import annotations

import json
import math

from learner_service.config import RewardShapingConfig
from sinkflex.api.common.v1 import common_pb2

#: wire reward type -> (tau2 RewardInfo field in details_json, the boolean of one check record)
_CHECKS = {
    common_pb2.REWARD_TYPE_ACTION: ("action_checks", "action_match", "action"),
    common_pb2.REWARD_TYPE_ENV_ASSERTION: ("env_assertions", "met", "env_assertion"),
    common_pb2.REWARD_TYPE_COMMUNICATE: ("communicate_checks", "met", "communicate"),
}


def check_shares(breakdown: common_pb2.RewardBreakdown) -> dict[str, float]:
    """{"action" | "env_assertion" | "communicate": share of that kind's checks passed} for the
    kinds whose records are in `breakdown` (unparseable or empty records are left out).

    Only checks in the task's reward basis: a component the reward service marks
    ``"in_basis": false`` (a check tau2 ran but the task is not scored on, e.g. the action
    checks of a DB-only task) gives no partial credit."""
    shares: dict[str, float] = {}
    for comp in breakdown.components:
        spec = _CHECKS.get(comp.type)
        if spec is None or not comp.details_json:
            continue
        field, flag, name = spec
        try:
            details = json.loads(comp.details_json)
            if details.get("in_basis") is False:  # a check tau2 ran outside the task's basis
                continue
            records = details.get(field) or []
        except (ValueError, AttributeError):
            continue
        flags = [bool(r.get(flag)) for r in records if isinstance(r, dict)]
        if flags:
            shares[name] = sum(flags) / len(flags)
    return shares


def shaped_reward(task_reward: float, breakdown: common_pb2.RewardBreakdown, cfg: RewardShapingConfig) -> float:
    """R_task + α · partial (module docstring); R_task unchanged when α = 0, when it is NaN
    (unscored) or when the breakdown holds no check records.

    Args:
        task_reward: τ²-Bench's reward of the trajectory, in [0, 1] (or NaN).
        breakdown: its RewardBreakdown from the reward service.
        cfg: the weights and α.
    """
    if cfg.alpha == 0 or math.isnan(task_reward):
        return task_reward
    shares = check_shares(breakdown)
    weights = {"action": cfg.action, "env_assertion": cfg.env_assertion, "communicate": cfg.communicate}
    total = sum(weights[k] for k in shares)
    if total <= 0:
        return task_reward
    partial = sum(weights[k] * v for k, v in shares.items()) / total
    return task_reward + cfg.alpha * partial
