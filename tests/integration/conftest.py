"""Fixtures of the integration tests."""

from training_utils import tiny_world  # noqa: F401
