"""The fault harness: a three-server JetStream cluster, two aggregators and five
agents, each in a network namespace of its own; a nemesis that crashes, pauses, partitions
and fills them on a seeded schedule; and a checker that reads what happened from the
outside and says what was lost, done twice or wrongly called stale.

``python -m tests.faults.run --minutes M --seed S`` runs it (as root: it makes network
namespaces, veth pairs, nft tables and tmpfs mounts, all named ``flt-``, and removes them).

- :mod:`~tests.faults.net`: namespaces, the bridge, cutting and healing links (nft);
- :mod:`~tests.faults.cluster`: the servers, aggregators and agents as processes;
- :mod:`~tests.faults.operator`: the operator sending signed commands, and the wiretap;
- :mod:`~tests.faults.nemesis`: the fault schedule and each fault;
- :mod:`~tests.faults.history`: what happened, read from streams, logs and state files;
- :mod:`~tests.faults.checker`: the verdict on a history (pure);
- :mod:`~tests.faults.run`: the command line.
"""
