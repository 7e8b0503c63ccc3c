"""Transformers re-scoring (rollout_service.rescore) on short synthetic trajectories (no engine)."""

from __future__ import annotations

import torch

from rollout_service.rescore import rescore, rescore_group, turn_mismatch
from sinkflex.api.common.v1 import common_pb2


def test_group_rescoring_with_shared_prefix_equals_full_forward(smollm2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = list(range(100, 140))
    trajs = []
    for i, tail in enumerate(([5, 6, 7, 8], [9, 10, 11], [5, 6, 12, 13, 14])):
        t = common_pb2.Trajectory(token_ids=prompt + tail)
        t.turns.add(generation_start=len(prompt), num_generated=len(tail))
        trajs.append(t)
    refs = rescore_group(model, trajs, temperature=0.7)
    for t, ref in zip(trajs, refs):
        full = rescore(model, t, temperature=0.7)
        assert ref.shape == full.shape == (len(t.token_ids),)
        # float32: the shared-prefix forward sums in another order than the full one; log-probs of
        # up to ~-25 nats then differ by a few ulp (5e-6 relative was seen): 1e-4 absolute plus 2e-5 relative
        torch.testing.assert_close(ref[len(prompt):], full[len(prompt):], atol=1e-4, rtol=2e-5)
        assert (ref[len(prompt):] < 0).all()
    # a trajectory whose engine log-probs are the re-scored ones has zero mismatch
    t = trajs[0]
    t.logprobs.extend([0.0] * len(prompt) + refs[0][len(prompt):].tolist())
    (m,) = turn_mismatch(model, t, 0.7, ref_T=refs[0])
    assert m.num_tokens == 4 and m.max_abs < 1e-6 and t.metrics["logprob_mismatch_turn0"] < 1e-6
