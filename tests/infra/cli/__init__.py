"""Tests of `infra.cli`."""
