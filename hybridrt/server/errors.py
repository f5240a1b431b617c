"""Errors as OpenAI sends them: `{"error": {"message", "type", "param", "code"}}` with an HTTP
status. Everything a handler raises ends up as one of these; clients never see a traceback."""
from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def queue_full(waiting: int) -> APIError:
    return APIError(503, f"server busy: all sessions are in use and {waiting} requests are already "
                    f"waiting; retry later", type="server_error", code="queue_full")


def internal(exc: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
