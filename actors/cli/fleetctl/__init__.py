"""``fleetctl``: the parser's assembly and ``main`` (``main.py``) and one module per group
of subcommands."""
