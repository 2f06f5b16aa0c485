"""Errors: one KvferryError subclass per kvferry status code (ErrorCode in layouts/status.h)."""

from __future__ import annotations

from typing import Optional

#: Status code -> name, as kvferry_status_name() gives them (checked against the library in tests).
STATUS_NAMES = {
    0: "ok",
    1: "invalid_argument",
    2: "out_of_range",
    3: "overflow",
    4: "misaligned",
    5: "not_found",
    6: "already_exists",
    7: "resource_exhausted",
    8: "unavailable",
    9: "internal",
    10: "unsupported",
    11: "protocol",
    12: "version_mismatch",
    13: "permission_denied",
    14: "checksum_mismatch",
    15: "timeout",
    16: "cancelled",
    17: "io",
    18: "cuda",
    19: "ucx",
    20: "config",
    21: "busy",
    22: "data_loss",
}
OK = 0
NOT_FOUND = 5
UNAVAILABLE = 8
TIMEOUT = 15
BUSY = 21


def status_name(code: int) -> str:
    return STATUS_NAMES.get(int(code), "unknown")


class KvferryError(Exception):
    """A failed kvferry call.

    ``code`` is the status code, ``name`` its name, ``message`` the library's explanation. For a
    data op that was served but failed for some blocks, ``statuses`` holds one status per block
    (a numpy int16 array, 0 = that block succeeded) and ``done`` the number of blocks that did;
    ``result`` is the op's result object (lookup/save/load/...) when there is one.
    """

    code = -1

    def __init__(self, message: str, *, code: Optional[int] = None, statuses=None, done: Optional[int] = None,
                 result=None):
        super().__init__(message)
        if code is not None:
            self.code = int(code)
        self.message = message
        self.statuses = statuses
        self.done = done
        self.result = result

    @property
    def name(self) -> str:
        return status_name(self.code)

    def failed_blocks(self):
        """Indices of the blocks that failed (empty when there are no per-block statuses)."""
        if self.statuses is None:
            return []
        import numpy as np

        return np.nonzero(self.statuses)[0]

    def __str__(self) -> str:
        return f"{self.name}: {self.message}"


class InvalidArgumentError(KvferryError):
    code = 1


class OutOfRangeError(KvferryError):
    code = 2


class OverflowKvError(KvferryError):
    code = 3


class MisalignedError(KvferryError):
    code = 4


class NotFoundError(KvferryError):
    code = 5


class AlreadyExistsError(KvferryError):
    code = 6


class ResourceExhaustedError(KvferryError):
    code = 7


class UnavailableError(KvferryError):
    """The daemon is gone (or a capability is missing): connect again."""

    code = 8


class InternalError(KvferryError):
    code = 9


class UnsupportedError(KvferryError):
    code = 10


class ProtocolError(KvferryError):
    code = 11


class VersionMismatchError(KvferryError):
    code = 12


class PermissionDeniedError(KvferryError):
    code = 13


class ChecksumMismatchError(KvferryError):
    code = 14


class TimeoutKvError(KvferryError):
    code = 15


class CancelledError(KvferryError):
    code = 16


class IoError(KvferryError):
    code = 17


class CudaError(KvferryError):
    code = 18


class UcxError(KvferryError):
    code = 19


class ConfigError(KvferryError):
    code = 20


class BusyError(KvferryError):
    code = 21


class DataLossError(KvferryError):
    code = 22


class ClosedError(KvferryError):
    """The Client was closed."""

    code = 8


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError, OutOfRangeError, OverflowKvError, MisalignedError, NotFoundError, AlreadyExistsError,
        ResourceExhaustedError, UnavailableError, InternalError, UnsupportedError, ProtocolError,
        VersionMismatchError, PermissionDeniedError, ChecksumMismatchError, TimeoutKvError, CancelledError, IoError,
        CudaError, UcxError, ConfigError, BusyError, DataLossError,
    )
}


def error_class(code: int) -> type:
    """The KvferryError subclass of a status code (KvferryError itself for unknown codes)."""
    return _BY_CODE.get(int(code), KvferryError)


def make_error(code: int, message: str, **kw) -> KvferryError:
    return error_class(code)(message, code=code, **kw)
