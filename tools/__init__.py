"""Maintenance programs run from the checkout (`python tools/<name>.py`)."""
