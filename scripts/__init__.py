"""Command-line tools: ``replay_trace.py`` (read, verify, export traces) and ``run_harness.py``
(one harness run as one session). Each runs as ``python scripts/<name>.py``; ``tool_hook``
(Claude Code's tool hook, which ``run_harness.py --tool-hooks`` installs) as ``python -m
interceptor.scripts.tool_hook``."""
