"""Tower families: one module each, registered in fsdpclip.jobspec.family.TOWER_FAMILIES."""
