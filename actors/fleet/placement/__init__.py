"""Fleet placement of workloads: choosing nodes (``choose``), the records in
``fleet_workloads`` (``store``), the reconciler's decisions (``reconcile``) and its actor."""
