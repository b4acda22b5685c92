"""What the long-running servers share: systemd readiness and watchdog pings (``systemd``), HTTP plumbing (``http``)."""
