"""Typed errors of the pagemesh client: one class per gRPC status a caller may want to catch.

Every error is a `PagemeshError` with the status `code` (a `grpc.StatusCode`) and the
server's `details` (which say what to fix). A stream that broke and could not be resumed
raises the class of the last failure it saw, with `num_resumes` telling how many times it
tried.
"""

from __future__ import annotations

import grpc


class PagemeshError(Exception):
    """A call to a pagemesh router failed. `code`: the gRPC status; `details`: why."""

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        code: grpc.StatusCode | None = None,
        *,
        request_id: str | None = None,
        num_resumes: int = 0,
    ) -> None:
        code = code or self.default_code
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.request_id = request_id  # the Generate request it belongs to, when one
        self.num_resumes = num_resumes  # resumes tried before giving up (streams only)


class InvalidArgument(PagemeshError, ValueError):
    """The request cannot be served as asked (INVALID_ARGUMENT, OUT_OF_RANGE,
    FAILED_PRECONDITION); the details say what to change. Also a ValueError, which is what
    `SamplingParams` raises for the same mistakes."""

    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PagemeshError):
    """NOT_FOUND: e.g. a resume of a request id with no checkpoint (finished and delivered,
    expired, or never sent)."""

    default_code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(PagemeshError):
    """RESOURCE_EXHAUSTED: the router's admission limit is full; back off and retry."""

    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PagemeshError):
    """UNAVAILABLE (and a broken stream that could not be resumed in time): no router
    answered, or no engine group is serving."""

    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PagemeshError):
    """DEADLINE_EXCEEDED: the call's `timeout_s` passed."""

    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unauthenticated(PagemeshError):
    """UNAUTHENTICATED: the router wants an API key (`api_key=`) and got none or a wrong one."""

    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(Unauthenticated):
    """PERMISSION_DENIED: the credentials are known but not allowed this call."""

    default_code = grpc.StatusCode.PERMISSION_DENIED


class Cancelled(PagemeshError):
    """CANCELLED: the call was cancelled (and not resumed)."""

    default_code = grpc.StatusCode.CANCELLED


class InternalError(PagemeshError):
    """INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED or another status: a server fault or a
    client/server version mismatch."""

    default_code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PagemeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def error_class(code: grpc.StatusCode) -> type[PagemeshError]:
    return _BY_CODE.get(code, InternalError)


def from_status(
    code: grpc.StatusCode, details: str, *, request_id: str | None = None, num_resumes: int = 0
) -> PagemeshError:
    return error_class(code)(details, code, request_id=request_id, num_resumes=num_resumes)


def from_rpc_error(
    exc: grpc.RpcError, *, request_id: str | None = None, num_resumes: int = 0
) -> PagemeshError:
    """The typed error of a failed call (sync `grpc.RpcError` or `grpc.aio.AioRpcError`)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    return from_status(
        code or grpc.StatusCode.UNKNOWN, details, request_id=request_id, num_resumes=num_resumes
    )
