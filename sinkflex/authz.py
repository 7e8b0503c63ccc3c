"""Per-method authorisation of the SinkFlex gRPC servers, by the caller's certificate.

Each service has its own identity: the common name (CN) of the certificate it presents as
a mutual-TLS client (`scripts/tls_dev_certs.py` issues one per service: ``env``,
``reward``, ``rollout``, ``learner``, ``driver``). A server with TLS on checks every call of
a protected action against an allow-list (`DEFAULT_RULES`):

    UpdateWeights (RolloutService)    learner, driver
    Checkpoint (LearnerService)       learner, driver
    Rollout with publish=true         driver   (the servicer checks it: it depends on the request)

A caller without a certificate (TLS without client auth), or whose certificate names another
identity, gets PERMISSION_DENIED naming the action, the identities allowed and the one seen;
the servicer never runs, so nothing changes. Every other method is open to any caller the
TLS handshake accepted. With TLS off (the embedded default, every service on loopback) no
identity exists and nothing is checked: everything works as without this module.

`AuthzInterceptor(policy)` enforces the method rules on a server; `Policy.check(context,
action)` is what a servicer calls for a request-dependent rule (`PUBLISH`).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import grpc

from sinkflex.errors import ServiceError, bound_message

log = logging.getLogger(__name__)

#: The service identities (certificate common names) of a SinkFlex deployment.
IDENTITIES = ("env", "reward", "rollout", "learner", "driver")

UPDATE_WEIGHTS = "/sinkflex.api.rollout.v1.RolloutService/UpdateWeights"
CHECKPOINT = "/sinkflex.api.learner.v1.LearnerService/Checkpoint"
#: A Rollout request with publish=true (training data into the buffer).
PUBLISH = "RolloutService/Rollout with publish=true"

#: Action -> identities allowed (`Policy.rules`).
DEFAULT_RULES: dict[str, frozenset[str]] = {
    UPDATE_WEIGHTS: frozenset({"learner", "driver"}),
    CHECKPOINT: frozenset({"learner", "driver"}),
    PUBLISH: frozenset({"driver"}),
}


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The caller's identity: its certificate's common name (None: no client certificate,
    or a plaintext connection)."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # noqa: BLE001 - a context without an auth context: no identity
        return None
    names = auth.get("x509_common_name") or []
    if not names:
        return None
    name = names[0]
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)


@dataclass(frozen=True)
class Policy:
    """Who may do what on one server.

    Attributes:
        enforce: check the rules (True when the server runs TLS); False: allow everything.
        rules: action (a full method name, or `PUBLISH`) -> identities allowed; an action not
            listed is open.
    """

    enforce: bool = False
    rules: Mapping[str, Collection[str]] = field(default_factory=lambda: dict(DEFAULT_RULES))

    def denial(self, context: grpc.ServicerContext, action: str) -> str | None:
        """Why `action` is refused to this caller (None: allowed)."""
        if not self.enforce or action not in self.rules:
            return None
        allowed = self.rules[action]
        who = peer_identity(context)
        if who in allowed:
            return None
        seen = f"certificate of {who!r}" if who else "no client certificate"
        return (f"{action} is allowed to {', '.join(sorted(allowed))} only (a client certificate with that "
                f"common name, mutual TLS); this caller presented {seen}")

    def check(self, context: grpc.ServicerContext, action: str) -> None:
        """Raises ServiceError PERMISSION_DENIED when the caller may not do `action`."""
        why = self.denial(context, action)
        if why is not None:
            log.warning("refused: %s", why)
            raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, why)


def policy_for(tls) -> Policy:
    """The default policy of a server with `tls` (a `sinkflex.tls.TLSConfig` or None):
    enforced when TLS is on."""
    return Policy(enforce=bool(tls is not None and tls.active))


class AuthzInterceptor(grpc.ServerInterceptor):
    """Refuses calls of a protected method (`Policy.rules`) by a caller not allowed to make
    them: PERMISSION_DENIED before the servicer runs."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self.policy.enforce or method not in self.policy.rules:
            return handler
        policy = self.policy
        kind = {(False, False): "unary_unary", (False, True): "unary_stream",
                (True, False): "stream_unary", (True, True): "stream_stream"}[
            (handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, kind)

        if handler.response_streaming:
            def guarded(request, context):
                why = policy.denial(context, method)
                if why is not None:
                    log.warning("refused: %s", why)
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, bound_message(why))
                yield from behavior(request, context)
        else:
            def guarded(request, context):
                why = policy.denial(context, method)
                if why is not None:
                    log.warning("refused: %s", why)
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, bound_message(why))
                return behavior(request, context)
        return handler._replace(**{kind: guarded})
