"""The commands actor (``actor.py``): checks, the actions it runs, its store and hooks."""
