"""Adapters for training frameworks; each imports its framework only when it is used.

``nanguard.integrations.lightning`` and ``nanguard.integrations.transformers`` are imported on first
access (after a plain ``import nanguard`` too), so that importing nanguard never imports a framework.
"""

import importlib

_ADAPTERS = ("lightning", "transformers")


def __getattr__(name: str):
    if name in _ADAPTERS:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}; its adapters are {', '.join(_ADAPTERS)}")
