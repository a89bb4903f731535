"""fleetctl's renderings: the node table, summaries and event lines (``tables``) and
``describe``'s detail (``describe``)."""
