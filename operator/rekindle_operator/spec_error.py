"""The error every spec check raises (its own module: spec.py and model_source.py both raise it)."""

from __future__ import annotations


class SpecError(ValueError):
    """A spec the operator refuses; the message says which field to change and how."""
