"""The health limits both rooms read: the node's health actor judges by them, the views
draw them (the dashboard's threshold lines). Data only, like the XID catalog."""

from __future__ import annotations

HOT_GPU_C = 85.0
"""Any GPU above this makes the node's nvml check degraded."""
UNHEALTHY_BELOW = 50
"""A health score below this is unhealthy."""
DEGRADED_BELOW = 80
"""A health score below this (and not below UNHEALTHY_BELOW) is degraded."""
