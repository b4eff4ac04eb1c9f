"""Tests of `capture.audit.lake`."""
