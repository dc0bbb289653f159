# SPDX-License-Identifier: Apache-2.0
"""The exception every hila entry point raises for bad input."""
from typing import Optional


class HilaError(ValueError):
    """Bad input to a hila operator, state or layer.

    The C++ library's ``hila::Error`` arrives as this exception with the same message, e.g.
    ``hila: argument 'k': expected shape [2, 100, 4, 64] (same as q), got [2, 99, 4, 64]``.

    Attributes:
        argument: the name of the offending argument (``"q"``, ``"lam"``, ``"cu_seqlens"``,
            ``"init.H"``, ``"chunk"``, ...), or None when the error is not about one argument.
    """

    def __init__(self, message: str, argument: Optional[str] = None):
        super().__init__(message)
        self.argument = argument

    def __reduce__(self):  # picklable across processes (DataLoader workers, multiprocessing)
        return type(self), (str(self), self.argument)
