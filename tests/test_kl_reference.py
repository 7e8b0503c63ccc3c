"""The KL reference π_ref (grpo.beta > 0) is the policy RL starts from: the warm start's
weights after a warm start, kept across a restart (reloaded from the published warm-start
version, which pruning never deletes)."""

from __future__ import annotations

import torch

from tests.fixtures.learner import TINY_LLAMA, learner_config, make_group


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_reference_is_the_warm_start_policy_and_survives_a_restart(tmp_path, torch_one_thread):
    from learner_service.checkpoint import load_checkpoint, save_checkpoint
    from learner_service.loop import LearnerRunner
    from learner_service.publish import policy_dir, publish_policy
    from learner_service.sft import warm_start
    from learner_service.trainer import Learner

    cfg = learner_config(tmp_path / "run", arch=TINY_LLAMA, model={"attn_implementation": "sdpa"},
                         grpo={"beta": 0.1}, keep_policies=1, batch={"shared_prefix": False},
                         warm_start={"epochs": 1, "batch_size": 2, "lr": 1e-2})
    learner = Learner(cfg, metrics=False)
    initial = _params(learner.model)
    assert learner.reference_version == 0 and _max_diff(_params(learner.ref_model), initial) == 0.0

    demos = [make_group(f"d{i}", [1.0], seed=i) for i in range(4)]
    warm_start(learner, demos)
    ws = _params(learner.model)
    assert learner.state.warm_start_version == 1 == learner.reference_version
    assert _max_diff(ws, initial) > 1e-4  # the warm start moved the weights ...
    assert _max_diff(_params(learner.ref_model), ws) == 0.0  # ... and π_ref is exactly them
    save_checkpoint(learner)
    publish_policy(learner)

    # two RL steps with the KL term: the policy moves, π_ref does not; pruning (keep 1) spares v1
    for step in range(2):
        m = learner.train_step([make_group(f"g{step}", [0.0, 1.0, 0.5], seed=10 + step)])
        assert m["kl"] >= 0.0 and m["grad_norm"] > 0
        publish_policy(learner)
    assert _max_diff(_params(learner.ref_model), ws) == 0.0
    assert m["kl"] > 0.0  # the policy left the reference
    assert sorted(p.name for p in policy_dir(cfg.run_dir, 0).parent.glob("v*")) == ["v1", "v3"]
    save_checkpoint(learner)

    # a restarted learner: resumed weights are step 2's, π_ref is reloaded from v1
    again = Learner(cfg, metrics=False)
    load_checkpoint(again)
    assert again.state.policy_version == 3 and again.reference_version == 0
    LearnerRunner(again, buffer=None)._load_reference(again.state.warm_start_version)
    assert again.reference_version == 1
    assert _max_diff(_params(again.ref_model), ws) == 0.0
    assert _max_diff(_params(again.model), _params(learner.model)) == 0.0
