"""Command-line tools: ``replay_trace.py`` (read, verify, export traces) and ``run_harness.py``
(one harness run as one session). Each runs as ``python scripts/<name>.py``."""
