"""The recipe's tests run under the product tests' settings: offline, one torch thread, the `needs` marker."""

from tests.conftest import pytest_configure, pytest_runtest_setup  # noqa: F401
