"""The read side: the fleet HTTP API (``api``), live reads of each node's latest accepted
heartbeat (``live``), a node's history from the streams (``history``) and the dashboard."""
