"""The package's version, in one place: setup.cfg reads it (``attr:``), and every trace
header names it (``producer_version``), so a file says which code wrote it even from a
checkout whose installed metadata is stale (an editable install keeps the version it was
installed with)."""

VERSION = "0.1.0"
