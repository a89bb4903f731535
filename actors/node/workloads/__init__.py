"""The workload actor (``actor.py``): deploys and stops inference engines (or allowed
processes) on the node's GPUs, supervises them and reports them as ``Workloads`` events;
``launch`` builds and polices their command lines, ``processes`` starts, finds and stops
their process groups, ``store`` keeps the desired set across agent restarts."""
