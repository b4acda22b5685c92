"""Fleet simulation: many edge boxes against a prefill tier of R replicas, its report, and the live check
of the simulator against a real two-replica tier (tools/README.md)."""
