"""Tests of `capture.audit.evidence`."""
