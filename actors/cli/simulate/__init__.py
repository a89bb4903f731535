"""``fleetctl simulate``: the run and its figures (``run``), the simulated nodes and their
paced publish (``publisher``), and its worker processes (``processes``, ``worker``)."""
