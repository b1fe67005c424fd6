"""Errors the CLI turns into one line; kept free of heavy imports, so `empo2` can catch them without
loading Lightning."""


class NonFiniteLossError(RuntimeError):
    """Raised after `trainer.max_nonfinite_steps` consecutive skipped steps (a checkpoint is saved first)."""
