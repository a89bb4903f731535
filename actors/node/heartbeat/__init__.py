"""The heartbeat actor (``actor.py``) and the sequence numbers that only ever grow."""
