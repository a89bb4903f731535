"""The command lines, ``node-agent`` and ``fleetctl``: parsers, views, ``up``, ``simulate``."""
