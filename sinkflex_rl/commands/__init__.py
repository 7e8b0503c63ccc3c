"""Command groups of the `sinkflex-rl` CLI (one module each; imports stay light)."""


def check_address(address: str | None) -> str | None:
    """A typer callback for a server's "host:port" option or argument: None passes; a missing or
    non-numeric port, or one outside 1–65535, is a usage error naming the value (exit 2).
    IPv6 hosts are written in brackets ("[::1]:50051")."""
    if address is None:
        return None
    import typer

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise typer.BadParameter(f"{address!r} is not host:port with a port in 1–65535")
    return address


def positive_seconds(value: float | None) -> float | None:
    """A typer callback for a number of seconds (a timeout): None passes; anything but a finite
    number > 0 (0, negative, nan, inf) is a usage error naming the value (exit 2)."""
    import math

    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        import typer

        raise typer.BadParameter(f"{value} is not a number of seconds > 0")
    return value


def env_client(env: str, address: str | None, ready_timeout: float, user_model: str | None = None,
               user_base_url: str | None = None, task_files: list[str] | None = None):
    """The env client of a CLI command: gRPC to the server at `address` once it is SERVING, or the
    env service in-process for domain `env` (with `task_files` and the user simulator's model).

    Raises:
        ValueError: nothing SERVING at `address` within `ready_timeout` seconds, or an unknown domain.
    """
    if address:
        from env_service.client import GrpcEnvClient
        from sinkflex.serving import wait_for_serving

        client = GrpcEnvClient(address, timeout=120)
        try:
            wait_for_serving(client.channel, "", timeout=ready_timeout)
        except TimeoutError:
            raise ValueError(f"no env server SERVING at {address} within {ready_timeout:g} s") from None
        return client
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig

    kw: dict = {"domains": (env,)}
    if task_files:
        kw["task_files"] = {env: task_files}
    if user_model:
        kw["user_model"] = user_model
    if user_base_url:
        kw["user_base_url"] = user_base_url
    return LocalEnvClient(EnvServiceConfig(**kw))
