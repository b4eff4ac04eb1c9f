"""The ``reprolane`` command line's root: the one app, the one command tree, the one error boundary.

- `infra.cli.root`: the root app (the ``reprolane`` entry point, ``infra.cli.root:app``), which loads each command
  on first use and turns whatever a command raises into one line on stderr and its exit code (`OneLineErrors`);
- `infra.cli.commands`: the command tree, written once: `SOURCES` names each command's module and attribute as
  strings, `TREE` places the commands in their groups;
- `infra.cli.schemas_cli`: ``reprolane schemas``, the contract's JSON Schemas (`schemas` does no IO, so its
  command lives here).

It is the top of the house. It reaches every package's commands by name (`importlib`, through `SOURCES`), so its
own imports are few: `schemas`, the engine-log switch of the replayer (`replayer.machine_output`) and the running
stack's defaults (`infra.stack.env`). Nothing of ours imports it. The options that infra's commands share stay at
the root of ``infra`` (`infra.cli_options`): the stack's and the model's commands use them, and the root imports
the stack, so here they would tie the two packages into a loop.
"""
