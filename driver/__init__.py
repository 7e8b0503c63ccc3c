"""The driver: the layer above the services.

The experiment config (`driver.config`), the services' clients (`driver.clients.connect`),
the training controller (`driver.controller`),
the local launcher of the embedded default (`driver.launcher`, `driver.local`) and the
`sinkflex-rl` command line (`driver.cli`, one module per command group under
`driver.commands`). `sinkflex-rl train -c CONFIG` runs rollouts → reward → Redis → GRPO →
new policy version → rollouts on the new version, on local processes or on services that
already run (docker compose, Kubernetes). The foundation package `sinkflex` never imports
this package or any service.
"""
