"""What the node knows about GPUs, shared by the inventory and health: the GPU health
thresholds (``thresholds``), the XID table (``xid``) and how many GPUs it can give
(``capacity``)."""
