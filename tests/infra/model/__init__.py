"""Tests of `infra.model`."""
