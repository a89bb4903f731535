"""The health actor (``actor.py``), its hard checks and the explained score."""
