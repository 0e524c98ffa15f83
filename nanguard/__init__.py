"""nanguard: stop a distributed PyTorch job at the first NaN/Inf, before the bad update."""

from .errors import (
    ConfigError,
    GuardClosedError,
    NanguardError,
    NonFiniteError,
    ProtocolError,
    StopRequested,
)
from .events import Event
from .guard import Guard, init

__all__ = [
    "ConfigError",
    "Event",
    "Guard",
    "GuardClosedError",
    "NanguardError",
    "NonFiniteError",
    "ProtocolError",
    "StopRequested",
    "init",
]
__version__ = "0.1.0"
