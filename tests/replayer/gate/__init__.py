"""Tests of `replayer.gate`."""
