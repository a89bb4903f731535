"""What is true of the nodes now, for every view and every decision: the one way any of
them reads a node (docs/live-reads.md says what each reads and how fresh it is).

``reader``  each node's latest *accepted* heartbeat read from FLEET_HB over its record
            (``read_fleet``, ``read_node``, ``overlay``): the views' reads, on demand;
            it judges what ``stored_heartbeats`` reads (the latest messages, the nodes'
            keys, the consumers' ack floors) and adds ``fleet_facts`` (maintenance,
            policy hold, workload status).
``held``    what a reader in an aggregator's process sees of the nodes that aggregator
            holds in memory (the ``Held`` window), never the aggregator itself.
"""
