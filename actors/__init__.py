"""Behaviour of nats-node-agent, in four rooms. (``schemas/`` beside it is the wire contract.)

General layout
==============

``runtime/``  knows nothing of nodes or fleets: the bus (a Protocol over nats-py, the actor
              skeleton ``listening``), durable consumers that settle every message and come
              back when deleted (``consumer``), KV helpers, the layered config loader, TLS
              client contexts, the supervisor, schedule and backoff, atomic files, logs,
              bounded memories, systemd notifications, serving aiohttp (bounded), Python
              child processes, signature checks shared with helper processes, and an
              embedded nats-server.
``node/``     the ``node-agent`` process: ``agent.py`` builds and supervises the actors below,
              ``config.py`` and ``metrics.py`` are the node's, ``gpu/`` is what the node knows
              of GPUs (health thresholds, the XID table, capacity), ``results.py`` publishes
              its signed answers to commands, ``tuning.py`` is how an actor takes the
              fleet's live settings.
``fleet/``    the provider side, in wings (``fleet/__init__.py`` maps them): ``process.py``
              puts the fleet process together; ``aggregator/`` judges heartbeats;
              ``alerts/`` publishes and forwards alerts; ``views/`` is the read side (the
              HTTP API, live reads, history, the dashboard); ``operator/`` answers
              operators; ``storage/`` provisions and reads the streams and buckets;
              ``placement/`` and ``remediation/`` act on the fleet.
``cli/``      the command lines: ``node_agent.py`` and ``fleetctl/`` (one module per group of
              subcommands), fleetctl's renderings (``render/``) and simulator
              (``simulate/``), what both share (``common.py``; ``parsing.py`` and
              ``lazy.py``, which keep a short command's start short), and
              ``single_file.py``, the entry point of the single-file artifact
              (``python -m deploy.build``).

Imports flow one way: ``schemas <- runtime <- {node, fleet} <- cli``. ``node`` and ``fleet``
never import each other, and no actor imports another: they share only ``schemas``, the
runtime and their room's helpers. ``pyproject.toml`` states this as import-linter contracts,
which the tests check.

The actors and what they say to each other
==========================================

Subjects below use the default prefix ``fleet``; ``<node>`` and ``<cluster>`` are the
node's own. Events (``fleet.evt.<node>.<kind>``) are core NATS, local to the node, signed
with the node's key and tagged with the agent process's session (``node/session.py``): an
actor acts only on an event its own process published (or a trusted operator's signed
``inject``), never on one merely signed with the node key, which a copy of the key can
sign anywhere (``node/events.py``). Readers outside the process take events, like the
heartbeat, as the node's signed claims.

Node (``actors/node``; ``node/agent.py`` starts them):

- ``inventory/``  listens to ``evt.<node>.{inject,settings}``; publishes ``Sample`` on
                  ``evt.<node>.sample``.
- ``health/``     listens to ``evt.<node>.{sample,engine,latency,scheduler,settings}``;
                  publishes ``Health`` on ``evt.<node>.health``.
- ``engine``      probes the configured inference engines and the ready workloads (from
                  ``evt.<node>.workloads``) over HTTP; publishes ``Engine`` on
                  ``evt.<node>.engine``.
- ``latency``     answers ``fleet.probe.<node>``, probes its peers' (found in KV ``fleet_nodes``),
                  listens to ``evt.<node>.settings``; publishes ``Latency`` on
                  ``evt.<node>.latency``.
- ``spot``        polls the cloud's metadata service, listens to
                  ``evt.<node>.{state,inject,settings}`` (an operator's ``inject spot``
                  rehearses a notice); publishes ``Interruption`` on
                  ``evt.<node>.interruption`` and ``CloudFacts`` on ``evt.<node>.cloud``.
- ``commands/``   consumes its node's ``Command`` from ``fleet.cmd.<cluster>.<node>``
                  (stream ``FLEET_CMD``), listens to
                  ``evt.<node>.{engine,gateway,health,interruption,scheduler}`` and its own
                  heartbeats (those its process tagged); publishes ``NodeState`` on
                  ``evt.<node>.state`` and signed ``CommandResult`` on
                  ``fleet.result.<cluster>.<node>`` (``FLEET_EVENTS``);
                  hands deploy and stop to the workload actor on ``evt.<node>.workload_order``.
- ``workloads/``  listens to ``evt.<node>.{workload_order,sample,state}``; runs deployed
                  engines as process groups; publishes ``Workloads`` on
                  ``evt.<node>.workloads`` and signed ``CommandResult`` for deploy and stop.
- ``scheduler``   runs Slurm's tools (``node/slurm.py``, which ``commands/`` uses to drain and
                  resume through Slurm), listens to ``evt.<node>.settings``; publishes
                  ``Scheduler`` on ``evt.<node>.scheduler``.
- ``settings/``   reads KV ``fleet_settings`` (one batched direct get) and its own heartbeats
                  (its labels); publishes ``Settings`` on ``evt.<node>.settings``: the
                  fleet's live values, which the actors that read them take
                  (``node/tuning.py``), and the status its heartbeat carries.
- ``heartbeat/``  listens to every ``evt.<node>.*``; publishes the signed ``Heartbeat`` on
                  ``fleet.hb.<cluster>.<node>`` (stream ``FLEET_HB``, per-message TTL; stored
                  as ``fleet.hb.<P>.<cluster>.<node>``, P the node's partition).
- ``http_api``    listens to every ``evt.<node>.*``; serves ``/metrics``, ``/healthz``, ``/status``,
                  ``/v1/node/inventory``.
- ``gateway/``    listens to ``evt.<node>.{workloads,state,sample}``; publishes ``Gateway`` on
                  ``evt.<node>.gateway``; serves the OpenAI-compatible API on 127.0.0.1.
- ``standing``    reads its own record in KV ``fleet_nodes`` (one filtered direct get); says on
                  ``/status`` and in the log when the aggregators refuse its heartbeats.

Fleet (``actors/fleet``; ``fleet/process.py`` starts them, the aggregator first):

- ``aggregator/``  consumes the partitions of ``FLEET_HB`` whose leases it holds
                  (``fleet.hb.<P>.*.*``, one durable each, KV ``fleet_leases``), answers
                  ``fleet.register``, follows KV ``fleet_trust``; writes KV ``fleet_nodes`` and
                  publishes ``Alert`` on ``fleet.alert.<kind>.<cluster>.<node>`` (``FLEET_ALERTS``).
- ``live/state_index`` counts the nodes of the partitions the aggregator holds (from its
                  record writes) and writes KV ``fleet_index`` (one ``PartitionIndex`` per
                  partition) when a state changed, at most once a second, and every 30 s.
- ``operator/forget`` answers ``fleet.forget`` (an operator's signed ``Forget``): verified
                  against ``trust_operators``, then the node is forgotten in KV.
- ``operator/maintenance`` answers ``fleet.maintenance`` (an operator's signed window),
                  verified as ``forget``; writes KV ``fleet_maintenance``.
- ``live/feed``   (when anything below reads it) follows KV ``fleet_nodes`` for the nodes the
                  aggregator beside it does not hold and that aggregator's memory for those
                  it holds; publishes nothing. The process's one copy of every node's
                  record, handed to the readers below (as the aggregator's view is), never
                  imported by them as an actor.
- ``operator/policy_requests`` answers ``fleet.policy`` (an operator's signed breaker
                  reset or hold clear), verified as ``forget``; writes KV ``fleet_policy``,
                  publishes ``Alert`` (remediation).
- ``remediation/`` (with a policy file) reads the live feed, KV ``fleet_maintenance`` and
                  ``fleet_policy``, and its nodes' answers in ``FLEET_EVENTS``; writes
                  ``fleet_policy``, publishes signed ``Command`` on ``fleet.cmd.<cluster>.<node>``
                  and ``Alert`` (remediation, breaker_tripped, needs_attention).
- ``placement/``  (with ``workloads_key_file``) reads the live feed (woken by writes of the
                  nodes its workloads run on) and KV ``fleet_workloads`` and
                  ``fleet_maintenance``; writes ``fleet_workloads``, publishes signed deploy
                  and stop ``Command``.
- ``views/api``   reads the live feed; serves ``/nodes``, ``/nodes/<id>`` (with each node's
                  latest accepted heartbeat from FLEET_HB), ``/metrics``, ``/healthz``.
- ``views/dashboard/`` serves ``/`` and its pages on the API's port: reads ``FLEET_ALERTS``,
                  ``FLEET_EVENTS``, KV ``fleet_leases``, ``fleet_maintenance``, ``fleet_policy``
                  and ``fleet_workloads``; publishes only the signed ``Command`` an operator
                  confirms.
- ``alerts/alertmanager`` (with ``alertmanager_urls``) consumes ``FLEET_ALERTS`` (one durable),
                  reads the held nodes, the live feed (an event's node) and KV
                  ``fleet_maintenance``; posts to Alertmanager, publishes nothing.

tests/system/test_actor_map.py checks both lists against the actors the two processes
start.
"""
