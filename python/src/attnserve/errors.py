"""The one exception the attnserve client raises: a gRPC status code and the server's message."""

from __future__ import annotations

from typing import Optional

import grpc

# google.rpc.Code numbers (ForwardResponse.error_code on a stream) to grpc.StatusCode.
_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


class AttnServeError(Exception):
    """A call that did not succeed.

    Attributes:
      code: the grpc.StatusCode (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ...).
      message: the server's message, which names the field, the expected and the
        actual value (DESIGN.md §2); or the client's own, for inputs it cannot encode.
      request_id: the request's id when the error belongs to one request of a stream.
    """

    def __init__(self, code: grpc.StatusCode, message: str, request_id: Optional[str] = None):
        self.code = code
        self.message = message
        self.request_id = request_id
        where = f" (request {request_id})" if request_id else ""
        super().__init__(f"{code.name}: {message}{where}")

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> "AttnServeError":
        """Wraps a failed RPC (sync or grpc.aio)."""
        code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
        details = error.details() if callable(getattr(error, "details", None)) else str(error)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")

    @classmethod
    def from_code_number(cls, number: int, message: str,
                         request_id: Optional[str] = None) -> "AttnServeError":
        """From a google.rpc.Code number, as a ForwardStream response carries it."""
        return cls(_CODE_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN), message, request_id)


def invalid_argument(message: str) -> AttnServeError:
    """An input the client cannot put on the wire (same code the server would give)."""
    return AttnServeError(grpc.StatusCode.INVALID_ARGUMENT, message)
