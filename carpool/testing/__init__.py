"""Test helpers that ship with the package (the fault-injecting server)."""
