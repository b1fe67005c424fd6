"""EMPO²: memory-augmented exploration with hybrid on- and off-policy optimisation for LLM agents."""
__version__ = "0.1.0"
