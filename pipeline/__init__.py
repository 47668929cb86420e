"""qship: quantize, evaluate, gate, package and verify Hugging Face causal LMs."""

__version__ = "0.1.0"
