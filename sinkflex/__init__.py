"""SinkFlex-RL: reinforcement learning for long-horizon tool-use agents.

The shared library of the four services (env, rollout, reward, learner): generated gRPC
contracts (`sinkflex.api`), gRPC serving helpers (`sinkflex.serving`), configuration,
the trajectory buffer, the sink-aware attention path, the CLI and the local launcher.
"""

__version__ = "0.1.0"
