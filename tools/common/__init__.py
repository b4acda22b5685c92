"""What the tools share: the main() skeleton (cli.py) and real servers on loopback (servers.py)."""
