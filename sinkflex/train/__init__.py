"""The main job: `sinkflex-rl train -c CONFIG` runs rollouts → reward → Redis → GRPO →
new policy version → rollouts on the new version, on local processes or on services that
already run (docker compose, Kubernetes)."""
