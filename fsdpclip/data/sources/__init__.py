"""Data sources: one module each, registered in fsdpclip.data.source.DATA_SOURCES."""
