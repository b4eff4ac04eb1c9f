"""The demo (``reprolane demo``): the whole product on one machine, end to end, in a few minutes.

- `infra.demo.run`: the run, step by step (the stack, the services, the workload, the replays, the summary);
- `infra.demo.services`: the processes it starts, each as a user starts it (``reprolane serve ...``);
- `infra.demo.workload`, `infra.demo.tools`: what it sends (prompts, workflows, the agents' tools);
- `infra.demo.kafka`, `infra.demo.audit`: what it reads back (the topics; the proofs and the lake);
- `infra.demo.summary`: what it prints; `infra.demo.cli`: the command.

It sits at the top of the house: it may import every service (capture, replayer, the audit jobs: it mints
operator keys and checks its run's proofs and lake) and infra's basement (the clients, the stack). Nothing
imports it; the command tree loads its command by name (`infra.cli.commands`).
"""
