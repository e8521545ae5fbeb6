"""surgeon: declarative hidden-state wiring for speculative-decoding drafts."""

__version__ = "0.1.0"
