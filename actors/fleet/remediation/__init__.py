"""The remediation policy: cordons, drains and returns nodes by itself, behind a breaker."""
