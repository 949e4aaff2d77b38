"""nvl72: an expert-parallel inference service for Qwen mixture-of-experts models."""

__version__ = "0.1.0"
