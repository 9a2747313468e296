"""One module per fuzz target, each with ``TestOneInput(data: bytes)`` (see fuzz/run.py --list)."""
