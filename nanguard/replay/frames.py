"""Where an operation came from: the user's frames of a Python stack, torch's, nanguard's and
Python's own left out.

A report names the line the user wrote (``return torch.log(x)`` in their module's forward), not
the frames of ``nn.Module.__call__`` or of nanguard's hooks around it.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
from types import FrameType
from typing import Any

import torch

USER, TORCH, NANGUARD, PYTHON = "user", "torch", "nanguard", "python"
MAX_FRAMES = 4  # user frames kept per operation, innermost first

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_NANGUARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_DEMO = os.path.join(_NANGUARD_DIR, "demo.py")
_PYTHON_DIRS = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep
                      for key in ("stdlib", "platstdlib")})
_ANOMALY_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>[^\n]+)\n'
                            r'(?:\s*(?P<code>[^\n]*)\n?)?')


def origin(filename: str) -> str:
    """Whose code a file is: ``user``, ``torch``, ``nanguard`` or ``python`` (the standard library)."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string> of exec'd code
        return PYTHON if filename.startswith("<frozen") else USER
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR):
        return TORCH
    if path.startswith(_NANGUARD_DIR) and path != _DEMO:  # (the demo's model and loop stand in for a user's)
        return NANGUARD
    if path.startswith(_PYTHON_DIRS) and "site-packages" not in path and "dist-packages" not in path:
        return PYTHON
    return USER


def _record(filename: str, line: int, function: str, code: str | None = None) -> dict[str, Any]:
    if code is None:
        code = linecache.getline(filename, line).strip()
    return {"file": filename, "line": line, "function": function, "code": code}


def calling_frames() -> tuple[str, list[dict[str, Any]]]:
    """Who called the running operation, and the user's frames of the stack (innermost first).

    The frames of the caller's own file (the dispatch mode) are left out first. The first value is the origin of
    the innermost frame that is neither torch's nor Python's: ``nanguard`` for an operation of
    nanguard's own hooks (which a report must not blame), ``user``, or ``python`` when the stack
    holds no such frame (the backward of a GPU runs on a thread without Python frames).
    """
    frame: FrameType | None = sys._getframe(1)
    own = frame.f_code.co_filename
    while frame is not None and frame.f_code.co_filename == own:
        frame = frame.f_back
    who = PYTHON
    frames: list[dict[str, Any]] = []
    while frame is not None and len(frames) < MAX_FRAMES:
        kind = origin(frame.f_code.co_filename)
        if kind == NANGUARD and who == PYTHON:
            return NANGUARD, []
        if kind == USER:
            who = USER
            frames.append(_record(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return who, frames


def anomaly_frames(traceback: Any) -> list[dict[str, Any]]:
    """The user's frames (innermost first) of the forward traceback that anomaly mode keeps in an
    autograd node's metadata (``traceback_``: strings as ``traceback.format_stack`` gives them)."""
    if not isinstance(traceback, (list, tuple)):
        return []
    frames = []
    for text in reversed(traceback):
        match = _ANOMALY_FRAME.match(text) if isinstance(text, str) else None
        if match is not None and origin(match["file"]) == USER:
            frames.append(_record(match["file"], int(match["line"]), match["function"].strip(),
                                  (match["code"] or "").strip()))
            if len(frames) == MAX_FRAMES:
                break
    return frames
