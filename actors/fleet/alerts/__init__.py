"""Alerts: publishing them with deterministic ids (``publisher``) and forwarding them to
Alertmanager (``alertmanager``)."""
