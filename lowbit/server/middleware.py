"""ASGI middleware: the API key check and the request-body size limit.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) so they never buffer or wrap a
streaming response, and a client disconnect still reaches the route.
"""

from __future__ import annotations

import json
import secrets


def error_body(message: str, kind: str, param: str | None, code: str | int | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_error(send, status: int, message: str, kind: str, code: str | None = None,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(message, kind, None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    def __init__(self, app, api_key: str | None, open_paths: tuple[str, ...]) -> None:
        self.app, self.api_key, self.open_paths = app, api_key, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return await send_error(send, 401, "a valid API key is required: 'Authorization: Bearer KEY'",
                                    "invalid_request_error", "invalid_api_key",
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads the body up front; more than `max_bytes` (declared or sent) answers 413."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send)
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect is left to hear

        return await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await send_error(send, 413, f"the request body is larger than {self.max_bytes} bytes",
                         "invalid_request_error", "request_too_large")
