"""Errors the CLI turns into one line; kept free of heavy imports, so `empo2` can catch them without
loading Lightning."""


class ConfigError(ValueError):
    """A config value or key that is not allowed. The message is a single line meant for users."""


class NonFiniteLossError(RuntimeError):
    """Raised after `trainer.max_nonfinite_steps` consecutive skipped steps (a checkpoint is saved first)."""


class Interrupted(BaseException):
    """Raised by the CLI's SIGINT handler. A BaseException, like KeyboardInterrupt, so no `except Exception`
    swallows it; unlike KeyboardInterrupt, Lightning re-raises it after its teardown instead of exiting 1."""
