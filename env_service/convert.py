"""Moved to `tau2_adapter.convert` (the τ²-Bench adapter, one copy for every service);
this name re-exports it for existing imports."""

from tau2_adapter.convert import (  # noqa: F401
    RAW_ARGUMENTS_KEY,
    format_arguments,
    from_tau2_message,
    from_tau2_messages,
    from_tau2_tool_call,
    parse_arguments,
    role_name,
    to_tau2_message,
    to_tau2_messages,
    to_tau2_tool_call,
)
