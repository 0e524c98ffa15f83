"""nanguard: stop a distributed PyTorch job at the first NaN/Inf, before the bad update.

``init``, ``Guard`` and ``skip_list`` (which need torch) are imported on first use, so that the
coordinator daemon and the operator commands, which share this package, never import torch.
"""

from ._dist import destroy_process_group
from ._version import __version__ as __version__  # (nanguard.__version__)
from .errors import (
    ConfigError,
    GuardClosedError,
    NanguardError,
    NonFiniteError,
    ProtocolError,
    ReplayFinished,
    StopRequested,
)
from .events import Event

__all__ = [
    "ConfigError",
    "Event",
    "Guard",
    "GuardClosedError",
    "NanguardError",
    "NonFiniteError",
    "ProtocolError",
    "ReplayFinished",
    "StopRequested",
    "destroy_process_group",
    "init",
    "skip_list",
]


def __getattr__(name: str):
    if name == "Guard":
        from .rank.guard import Guard

        return Guard
    if name == "init":
        from .api import init

        return init
    if name == "integrations":  # (nanguard.integrations.lightning... with a plain `import nanguard`)
        import importlib

        return importlib.import_module(f"{__name__}.integrations")
    if name == "skip_list":
        from .replay.skipfile import skip_list

        return skip_list
    raise AttributeError(f"module 'nanguard' has no attribute {name!r}")
