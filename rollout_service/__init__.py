"""The rollout service: the multi-turn agent loop on vLLM (SinkFlex-RL's rollout worker).

- engine.py      vLLM AsyncLLM on token ids (sampled-token log-probs, in-place weight reload)
- generator.py   `Generator`: what an episode needs from an engine; `ScriptedGenerator` (tests, demonstrations)
- formatting.py  first prompt + per-turn env suffixes on token ids (chat template / harmony)
- parsers.py     Hermes `<tool_call>` and harmony tool-call parsing
- episode.py     `run_episode(generator, env, formatter, spec) -> Episode` (frozen, with a status);
                 `episode_to_proto` builds the wire Trajectory
- agent.py       `AgentLoop`: episodes on the engine, groups of G, scoring, buffer writes
- worker.py      `RolloutWorker`: the service core, usable in-process
- server.py, client.py, __main__.py   the gRPC edge (`python -m rollout_service`)
- user_sim.py    OpenAI-compatible endpoint for the tau2 user simulator; `vllm serve` helper
- rescore.py     transformers re-scoring: engine/trainer log-prob mismatch per turn
"""
