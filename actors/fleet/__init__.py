"""The provider side: the aggregator, its record rules and stores, alerts, the fleet HTTP API."""
