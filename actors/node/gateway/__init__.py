"""The gateway actor (``actor.py``): the OpenAI-compatible API on the node; ``access``
(TLS, API keys, rate limits), ``lanes``, ``upstream`` and ``autostart`` (on-demand servers)."""
