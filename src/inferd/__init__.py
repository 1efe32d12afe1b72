"""inferd: a production inference service for transformer models."""

__version__ = "0.1.0"
