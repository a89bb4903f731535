"""What answers operators: signed requests (``requests``), enrollment tokens (``enroll``),
``fleetctl forget`` (``forget``), maintenance windows (``maintenance``) and signed commands
to nodes (``commands``)."""
