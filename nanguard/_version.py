"""The package's version: one place, read by pyproject.toml (setuptools' dynamic version) and by
every module that reports it, so that none of them imports the package root for it."""

__version__ = "0.1.0"
