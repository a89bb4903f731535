"""Attacks from the outside: a stolen node key, an unauthenticated client, hostile bytes."""
