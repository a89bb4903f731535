"""Knows nothing of nodes or fleets: the plumbing every process of the project runs on."""
