"""The driver: the layer above the services.

The experiment config (`sinkflex_rl.config`), the services' clients (`sinkflex_rl.clients.connect`),
the training controller (`sinkflex_rl.controller`),
the local launcher of the embedded default (`sinkflex_rl.launcher`, `sinkflex_rl.local`) and the
`sinkflex-rl` command line (`sinkflex_rl.cli`, one module per command group under
`sinkflex_rl.commands`). `sinkflex-rl train -c CONFIG` runs rollouts → reward → Redis → GRPO →
new policy version → rollouts on the new version, on local processes or on services that
already run (docker compose, Kubernetes). The foundation package `sinkflex` never imports
this package or any service.
"""
