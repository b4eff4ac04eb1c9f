"""Tests of `infra.stack`."""
