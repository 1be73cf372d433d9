"""Data sources: one module each, registered in fsdpclip.spec.registry.DATA_SOURCES."""
