"""The schedule recorder that runs *inside* the production vLLM (issue #22), not in the sidecar.

- `segments`: the segment writer: records queued by the engine step, encoded, written, fsynced and renamed on a
  background thread (`schemas.schedule_log` names the files); IO errors are counted and logged, never raised.
- `recorder`: `RecordingScheduler`, vLLM's scheduler with a recorder on the side, loaded by vLLM itself through
  ``--scheduler-cls capture.schedule.recorder.RecordingScheduler``. It is the one module of ``capture`` that
  imports vLLM (at module level: it subclasses vLLM's scheduler, and only vLLM ever imports it).

This package imports only `schemas` (an import-linter contract): the sidecar never imports it and it never imports
the sidecar, so vLLM's process loads nothing of the proxy.
"""
