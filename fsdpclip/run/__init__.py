"""The run directory: its lock, stop requests, exit reports, launch history and files; what this node has for its
ranks. No torch."""
