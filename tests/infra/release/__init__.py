"""Tests of `infra.release`."""
