"""The release: the version both programs' ``--version`` print and every heartbeat,
/status and the build-info metric carry. Pyproject's (tests/system/test_habits.py holds
them together); a module of its own, so ``--version`` imports nothing else."""

AGENT_VERSION = "0.6.0"
