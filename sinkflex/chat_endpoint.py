"""A minimal OpenAI-compatible chat-completions endpoint (stdlib HTTP, one thread a request).

τ²-Bench's `UserSimulator` calls `litellm.completion`; with model ``"openai/<name>"`` and
``api_base=ChatEndpoint.base_url`` litellm POSTs OpenAI chat completions
(https://platform.openai.com/docs/api-reference/chat/create) here. The endpoint answers the three
routes litellm and health checks use:

- ``POST /v1/chat/completions``: the request body (a JSON object) goes to `reply`, which returns
  a `ChatReply`; the answer is a non-streaming ``chat.completion`` object with one choice;
- ``GET /v1/models``: one model, `model_name`;
- ``GET /health`` (and ``/v1/health``): ``{"status": "ok"}``.

A request is untrusted input: a body over `max_body_bytes` gets HTTP 413, a body that is not a
JSON object or that `reply` refuses (`ValueError`, `KeyError`, `TypeError`) gets HTTP 400 with a
message of at most 500 characters, and any other error in `reply` gets HTTP 500; the server keeps
serving either way.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 500  # an error message's bound


@dataclass(frozen=True)
class ChatReply:
    """What `reply` returns: the assistant's text, the OpenAI finish_reason ("stop" | "length"),
    and token counts for ``usage`` (0 where not counted)."""

    text: str
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0


class ChatEndpoint:
    """Serves `reply` as OpenAI chat completions on HOST:PORT until `close` (see module docstring).

    Args:
        reply: request body (dict, the JSON object as sent) -> `ChatReply`; raises ValueError,
            KeyError or TypeError for a request it refuses (HTTP 400).
        model_name: the id in ``/v1/models`` and the default ``model`` of an answer.
        host, port: where to listen (port 0: a free port; see `.port`).
        name: the serving thread's name (logs).
        max_body_bytes: the largest request body read (larger: HTTP 413).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, reply: Callable[[dict], ChatReply], model_name: str, host: str = "127.0.0.1",
                 port: int = 0, name: str = "chat-endpoint", max_body_bytes: int = 8 << 20):
        self.reply, self.model_name, self.max_body_bytes = reply, model_name, max_body_bytes
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt, *args):
                log.debug(f"{name}: " + fmt, *args)

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, code: int, message: str, kind: str) -> None:
                self._send(code, {"error": {"message": message[:MAX_MESSAGE_CHARS], "type": kind}})

            def do_GET(self):
                path = self.path.rstrip("/")
                if path.endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                                                  "owned_by": "sinkflex"}]})
                elif path in ("/health", "/v1/health"):
                    self._send(200, {"status": "ok"})
                else:
                    self._error(404, f"no route {self.path}", "invalid_request_error")

            def do_POST(self):
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._error(404, f"no route {self.path}", "invalid_request_error")
                    return
                try:
                    length = int(self.headers.get("Content-Length", 0))
                except ValueError:
                    self._error(400, "bad request: Content-Length is not an integer", "invalid_request_error")
                    return
                if length > endpoint.max_body_bytes:
                    self._error(413, f"request body of {length} bytes is over the endpoint's "
                                     f"{endpoint.max_body_bytes}", "invalid_request_error")
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise TypeError(f"the body is a JSON {type(body).__name__}, not an object")
                    out = endpoint.reply(body)
                except (ValueError, KeyError, TypeError) as err:
                    self._error(400, f"bad request: {err}", "invalid_request_error")
                    return
                except Exception as err:  # a failed reply is the caller's 500; keep serving
                    log.exception("%s: reply failed", name)
                    self._error(500, str(err), "server_error")
                    return
                self._send(200, {
                    "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                    "model": body.get("model", endpoint.model_name),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": out.finish_reason}],
                    "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                              "total_tokens": out.prompt_tokens + out.completion_tokens}})

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self.host, self.port = host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        """The litellm `api_base`: http://HOST:PORT/v1."""
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        """Stops serving and frees the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
