"""Native helpers, built from C when a compiler is available (see setup.py)."""
