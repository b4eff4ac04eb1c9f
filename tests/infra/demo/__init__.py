"""Tests of `infra.demo`."""
