"""The replay matrix (`reprolane matrix`) and the runner that `reprolane explain` reuses.

- `dimensions`: the cells (engine configuration x schedule) and why a cell cannot run on this host.
- `inputs`: what is replayed: recorded envelopes or the bundled workload prompts, as `MatrixItem`s.
- `runner`: one spawned process per engine configuration; outputs, latencies, peak RSS per cell.
- `results`: every cell judged against the baseline with `replayer.compare`.
- `report`: terminal table, JSON, self-contained HTML.
- `run`: `run_matrix`, the whole pipeline.
- `cli`: the ``matrix`` and ``explain`` commands.
"""
