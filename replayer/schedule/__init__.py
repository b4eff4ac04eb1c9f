"""Schedule replay: a request replayed inside the batches it ran in, rebuilt from the engine's recorded schedule.

- `replayer.schedule.store` and `replayer.schedule.window`: an envelope's schedule read back from S3 and checked,
  and the window of it one replay needs (its busy period, and those of its prefix-cache providers);
- `replayer.schedule.plan`: what a replay runs, worked out from the log alone (pure: no engine, no IO);
- `replayer.schedule.engine` and `replayer.schedule.lane`: the in-process vLLM engine that records its own schedule,
  and the lane that drives it step by step through a plan (vLLM is imported inside their functions only);
- `replayer.schedule.replay`: one envelope, or a whole busy period's captured requests, replayed and compared
  (`ScheduleReplayer`: what the service and the command line call through `replayer.lane_choice`).

Like the rest of the replayer it imports schemas and `infra.clients`, never capture: the recorder's classes are
started by name (docs/SCHEDULE_REPLAY.md).
"""
