"""Deployment files (nats-server configs, systemd units, install steps, dashboards) and
``build.py``, which makes the single-file artifact of node-agent and fleetctl."""
