"""learner_service: GRPO (paper eqs. (3)–(7)) with FSDP2 on the sink attention path.

Modules, in the order data flows through them:
- `batch` — TrajectoryGroup protos → frozen `Group`s of `Rollout`s (once per group) →
  right-padded micro-batches;
- `advantage` — Â_i, eq. (3) (one pure function);
- `logprobs` — per-token log softmax(logits / temperature) and entropies;
- `loss` — the clipped GRPO loss with a k3 KL, eqs. (4)–(7) (one pure function);
- `model` — transformers causal LM with attn_implementation="sinkflex", FSDP2 sharding;
- `trainer` — `Learner.train_step(groups) -> metrics`: one step = one policy version;
- `checkpoint` — durable checkpoints and resume; `publish` — policy/v{N} + UpdateWeights;
- `loop` — `LearnerRunner(learner, buffer).run(max_steps)`: buffer → step → checkpoint →
  ack → publish, exactly-once by group id; `server` — LearnerService (gRPC);
- `__main__` — `python -m learner_service --config FILE` (under torchrun for FSDP2).

In-process use (one process, no torchrun)::

    from learner_service.config import LearnerConfig
    from learner_service.trainer import Learner
    from learner_service.checkpoint import load_checkpoint
    from learner_service.loop import LearnerRunner

    learner = Learner(LearnerConfig.model_validate({"model": {"path": folder}, "run_dir": "runs/x"}))
    load_checkpoint(learner)                       # resume if run_dir has a checkpoint
    metrics = learner.train_step(groups)           # batch.Group or common_pb2.TrajectoryGroup
    LearnerRunner(learner, TrajectoryBuffer()).run(max_steps=10)

Importing this package imports nothing heavy; import the modules you need.
"""
