"""Data sources: one module each, registered in fsdpclip.jobspec.source.DATA_SOURCES."""
