"""`python -m edgedecode` runs the command line."""

from edgedecode.cli import app

app()
