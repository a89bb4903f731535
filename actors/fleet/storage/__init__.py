"""What the fleet keeps and how it is provisioned: streams and buckets (``streams``), node
records (``node_store``), trust and its operations (``registry``), maintenance windows
(``windows``), the policy's holds (``policy_holds``) and the servers' users and
permissions (``nats_config``)."""
