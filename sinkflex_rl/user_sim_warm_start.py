"""A user-simulator warm start: supervised fine-tuning of the user model on scripted dialogues.

τ²-Bench's `UserSimulator` asks its LLM for the user's next line with its own prompt: a system
message (τ²-Bench's simulation guidelines and the task's `<scenario>`), then the conversation
with the roles flipped (the agent's messages as "user", the user's own as "assistant"; tool
calls are not shown to the user). `user_sim_examples` renders exactly that prompt, through the
model's chat template as the OpenAI-compatible server renders it (`add_generation_prompt`), for
every user line of the golden dialogues of generated dual-control train tasks
(`tau2_adapter.generate_dual.golden_dialogue`), and appends the golden line and the end-of-turn
token: the loss mask is 1 exactly on those. The agent's questions are drawn from a few
paraphrases (seeded), so that the user answers a question it was not trained on word for word.

`train_user_sim` trains on them with the learner's own warm start (`learner_service.sft.warm_start`:
masked cross-entropy, AdamW, the learner's packing) and publishes the result as a model folder
(`learner_service.publish.publish_policy`) that vLLM serves as the user simulator. The AReaL-SEA
recipe also fine-tunes its user model; this is the smallest version of that.

    python -m sinkflex_rl.user_sim_warm_start --tasks 128 --out runs/user-sim-warm-start
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path

from sinkflex.api.common.v1 import common_pb2

log = logging.getLogger(__name__)

#: Paraphrases of the agent's questions in the training dialogues (the golden one first).
ASK_PARAPHRASES = {
    "create": ("Sure. What is your user id, and what title should the new task have?",
               "I can help with that. Could you tell me your user id and the title of the task?",
               "What is your user ID, and what should the task be called?",
               "Please give me your user id and the title you want for the new task."),
    "status": ("Sure. Which task is it (its task id), and which status do you want: pending or completed?",
               "Which task id is it, and should it be pending or completed?",
               "I can do that. What is the task id, and what status do you want?",
               "Please tell me the task id and the new status."),
}


def _greeting() -> str:
    from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE

    return DEFAULT_FIRST_AGENT_MESSAGE.content


def user_sim_messages(task, agent_texts: list[str], user_texts: list[str]) -> list[dict]:
    """The OpenAI messages τ²-Bench's `UserSimulator` sends for the user's next line, after the
    agent's text messages `agent_texts` (τ²-Bench's greeting first) and the user's own lines
    `user_texts` (one fewer than `agent_texts`), in τ²-Bench's user-simulator prompt format."""
    from tau2.user.user_simulator import UserSimulator

    system = UserSimulator(tools=None, instructions=task.user_scenario, llm="none").system_prompt
    out = [{"role": "system", "content": system}]
    for k, agent in enumerate(agent_texts):
        out.append({"role": "user", "content": agent})
        if k < len(user_texts):
            out.append({"role": "assistant", "content": user_texts[k]})
    return out


def user_sim_examples(tasks, tokenizer, seed: int = 0, paraphrase: bool = True) -> list[common_pb2.TrajectoryGroup]:
    """One group per task: a trajectory per user line of its golden dialogue (token ids of the
    user-simulator prompt + the line + end of turn; loss mask 1 on the line and end of turn).

    Args:
        tasks: generated dual-control τ²-Bench Tasks (train split).
        tokenizer: the user model's tokenizer (its chat template renders the prompt).
        seed: seed of the paraphrase draws.
        paraphrase: draw the agent's questions from `ASK_PARAPHRASES` (else the golden ones).
    """
    from tau2_adapter.generate_dual import ASK_CREATE, ASK_STATUS, golden_dialogue

    rng = random.Random(seed)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
    groups = []
    greeting = _greeting()
    for task in tasks:
        agent_texts, user_texts = [greeting], []
        group = common_pb2.TrajectoryGroup(group_id=f"user-sim-{task.id}", task_id=task.id, env="mock")
        for role, turn in golden_dialogue(task):
            if role == "user":
                prompt = list(tokenizer.apply_chat_template(user_sim_messages(task, agent_texts, user_texts),
                                                            add_generation_prompt=True, tokenize=True, return_dict=False))
                target = list(tokenizer.encode(turn, add_special_tokens=False)) + [eot]
                group.trajectories.add(trajectory_id=f"{task.id}-u{len(user_texts)}", task_id=task.id, env="mock",
                                       token_ids=prompt + target, logprobs=[0.0] * (len(prompt) + len(target)),
                                       loss_mask=[0] * len(prompt) + [1] * len(target), reward=1.0)
                user_texts.append(turn)
            elif turn.tool is None and not turn.stop:  # a question the user sees
                text = turn.content
                if not paraphrase:
                    pass
                elif text == ASK_CREATE:
                    text = rng.choice(ASK_PARAPHRASES["create"])
                elif text == ASK_STATUS:
                    text = rng.choice(ASK_PARAPHRASES["status"])
                agent_texts.append(text)
        groups.append(group)
    return groups


def train_user_sim(model_dir: str, groups: list[common_pb2.TrajectoryGroup], out_dir: str | Path, epochs: int = 2,
                   lr: float = 1e-4, batch_size: int = 8, micro_batch_size: int = 8, seed: int = 0) -> dict:
    """Supervised warm start of the user model on `groups` with the learner's own SFT; publishes
    it. Returns {"model": the published folder, metrics...}.

    Raises:
        ValueError: no trainable token in `groups`.
    """
    from learner_service.config import LearnerConfig
    from learner_service.publish import publish_policy
    from learner_service.sft import warm_start
    from learner_service.trainer import Learner

    cfg = LearnerConfig.model_validate(dict(
        run_dir=str(out_dir), model=dict(path=str(model_dir), seed=seed),  # the sink path: shared-prefix rows
        optim=dict(lr=lr), batch=dict(micro_batch_size=micro_batch_size),
        warm_start=dict(epochs=epochs, lr=lr, eps=1e-5, batch_size=batch_size), tensorboard=False))
    learner = Learner(cfg, metrics=False)
    t0 = time.perf_counter()
    metrics = warm_start(learner, groups)
    pub = publish_policy(learner)
    return {"model": str(pub.location), **metrics, "seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description="Train the user simulator on scripted dialogues of generated train tasks.")
    p.add_argument("--tasks", type=int, default=128, help="train tasks (families cycled)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (the fidelity benchmark's test split uses the same)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--model", default=None, help="model folder (default: the prepared SmolLM2)")
    p.add_argument("--out", default="runs/user-sim-warm-start")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from transformers import AutoTokenizer

    from sinkflex.models import prepare_model
    from tau2_adapter.generate_dual import generate_dual_tasks

    model = args.model or str(prepare_model("smollm2"))
    ts = generate_dual_tasks(train=args.tasks, test=0, seed=args.seed)
    tok = AutoTokenizer.from_pretrained(model)
    groups = user_sim_examples([ts.tasks[i] for i in ts.splits["train"]], tok, seed=args.seed)
    n = sum(len(g.trajectories) for g in groups)
    tokens = sum(len(t.token_ids) for g in groups for t in g.trajectories)
    log.info("user-simulator warm start: %d examples (%d tokens) from %d train tasks", n, tokens, len(groups))
    result = train_user_sim(model, groups, args.out, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                            seed=args.seed)
    result.update({"examples": n, "tokens": tokens, "train_tasks": len(groups), "epochs": args.epochs, "lr": args.lr})
    Path(args.out, "user_sim_warm_start.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
