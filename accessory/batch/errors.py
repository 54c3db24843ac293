"""The one error of `accessory batch`: an input record, output file or option it cannot use, named with its line
(the CLI logs it and exits 2)."""
from __future__ import annotations

from accessory.errors import AccessoryError


class BatchInputError(AccessoryError, ValueError):
    """An input record, output file or option of `accessory batch` that cannot be used as it is."""
