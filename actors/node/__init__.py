"""The ``node-agent`` process: its actors (one module or subpackage each), config and metrics."""
