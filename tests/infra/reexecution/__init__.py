"""Tests of `infra.reexecution`."""
