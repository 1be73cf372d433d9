"""The run directory: its lock, stop requests, exit reports and launch history. No torch."""
