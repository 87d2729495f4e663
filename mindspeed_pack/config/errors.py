"""The error a bad flag or flag combination raises (the parser turns it into one usage line)."""
from __future__ import annotations


class ArgumentError(ValueError):
    """An invalid flag or combination of flags."""
