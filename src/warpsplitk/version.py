"""The package version: equal to pyproject.toml's (a test checks), read by
the records and cache keys that name the build."""

__version__ = "0.1.0"
