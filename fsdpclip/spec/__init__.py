"""The job spec and what reads it: pydantic declarations, job files, the starter spec, what a relaunch may change.
No torch."""
