"""Where a turn's KV comes from and how it is pulled: the planner (``planner.KVPlanner``: the links
and this box's speed, learned, and ``adaptive``'s choice) and the remote (``remote.PrefillRemote``:
the prefill server's HTTP session, the circuit breaker and the ingest thread; a pull in segments,
``fetch``, one at a time, ``segment``)."""
