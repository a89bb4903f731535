"""Behaviour of nats-node-agent: the runtime (bus, supervisor, config), the actors, the CLIs."""
