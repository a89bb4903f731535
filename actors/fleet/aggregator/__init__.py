"""The aggregator (``actor.py``): the heartbeat path, from a partition of FLEET_HB to the
node records of ``fleet_nodes``, one job a module."""
