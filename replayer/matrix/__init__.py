"""The replay matrix (`reprolane replay matrix`), and `reprolane replay explain`, which runs its variations as
matrix cells.

- `dimensions`: the cells (engine configuration x schedule) and why a cell cannot run on this host.
- `inputs`: what is replayed: recorded envelopes or the bundled workload prompts, as `MatrixItem`s.
- `execution`: one spawned process per engine configuration; outputs, latencies, peak RSS per cell.
- `results`: every cell judged against the baseline with `replayer.compare`.
- `report`: terminal table, JSON, self-contained HTML.
- `pipeline`: `run_matrix`, the whole pipeline (plan, execute, judge).
- `explain`: one recorded request re-run under targeted variations, to name the one that reproduces its fork.
- `cli`: the ``matrix`` and ``explain`` commands.

The engine each cell runs on is `replayer.lanes.batch_engine` (it imports torch and vLLM, so it lives with the
lanes); this package imports it, and `replayer.lanes` never imports this package.
"""
