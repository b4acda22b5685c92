"""The project's tools: benchmarks, adversarial runs, quality studies and fleet simulations (tools/README.md).

Scripts, not part of the shipped package: each runs as ``python tools/<group>/<name>.py`` from the repo
root and imports the others as ``tools.<group>.<module>`` (tools/common/cli.py says how).
"""
