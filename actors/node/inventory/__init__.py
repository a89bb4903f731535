"""The inventory actor (``actor.py``) and the GPU sources it reads: NVML, simulated, kmsg XIDs."""
