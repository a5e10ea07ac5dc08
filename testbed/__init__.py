"""Test beds outside the engine: the emulated multi-host lab on network namespaces (`testbed.lab`)."""
