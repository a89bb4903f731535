"""The provider side, in wings; each wing imports only those below it (pyproject's
import contracts), and every module is in one.

``process.py``       the fleet process put together: the actors ``fleetctl aggregator``
                     and ``fleetctl up`` start, the aggregator first.
``views/``           the read side: the HTTP API (``api``), a node's history from the
                     streams (``history``), the dashboard.
``placement/``       placed workloads: choosing nodes, their records, the reconciler.
``remediation/``     the remediation policy: its file (``config``), what a record says is
                     wrong (``findings``), decisions and the breaker (``policy``),
                     what it knows of the fleet between rounds (``members``), hooks,
                     the actor.
``live/``            what is true of the nodes now, the one way the three wings above read
                     them: each node's latest accepted heartbeat (``reader``), the process's
                     live feed (``feed``), what a listed workload is now
                     (``workload_status``); what they read of the aggregator beside them is
                     ``held.Held``, never the aggregator itself.
``aggregator/``      the heartbeat path: where a heartbeat is judged (``judge``, pure),
                     from a partition of FLEET_HB (``ownership``, ``partitions``,
                     ``lease``) through ``verify`` to the node table (``ledger``, with
                     ``reads`` and ``writes``), the sweeps and ``fleet.register``.
``operator/``        what answers operators: the check of a signed request
                     (``requests``), ``forget``, ``maintenance``, the policy's reset and
                     clear (``policy_requests``), enrollment tokens (``enroll``) and a
                     signed command to a node (``commands``).
``alerts/``          where alerts are raised (``publisher``: deterministic ids, rate
                     limits) and forwarded (``alertmanager``).
``storage/``         what the fleet keeps: streams and buckets provisioned (``streams``),
                     node records (``node_store``), trust and its operations
                     (``registry``), leases as readers see them (``leases``), maintenance
                     windows (``windows``), the policy's holds (``policy_holds``), the
                     fleet's signed settings as stored (``settings``), a node's answers to
                     one command (``answers``), placed workloads as stored (``placed``),
                     the servers' users and permissions (``nats_config``).
shared               ``config`` and ``metrics`` of the aggregator process, ``labels``
                     (selectors), ``identity`` (enrolled identity against claims),
                     ``record_state`` (what a record's state is), ``changed_nodes``
                     (the nodes a fleet-wide job's round takes, bounded).
"""
