"""specdec: exact speculative decoding. This package imports no Ray."""

__version__ = "0.1.0"
