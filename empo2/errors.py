"""Errors the CLI turns into one line; kept free of heavy imports, so `empo2` can catch them without
loading Lightning."""


class NonFiniteLossError(RuntimeError):
    """Raised after `trainer.max_nonfinite_steps` consecutive skipped steps (a checkpoint is saved first)."""


class Interrupted(BaseException):
    """Raised by the CLI's SIGINT handler. A BaseException, like KeyboardInterrupt, so no `except Exception`
    swallows it; unlike KeyboardInterrupt, Lightning re-raises it after its teardown instead of exiting 1."""
