"""The fleet's settings on a node: which settings the fleet may set (``table``), the
signed entries a node takes and keeps (``entries``), the one read it makes of the bucket
(``bucket``), what it runs with as a result (``effective``), and the actor that follows
them (``actor``). docs/settings.md, "Fleet settings", says it for operators."""
