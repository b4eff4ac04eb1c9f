"""Tests of `replayer.schedule`."""
