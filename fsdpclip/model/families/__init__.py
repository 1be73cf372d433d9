"""Tower families: one module each, registered in fsdpclip.model.family.TOWER_FAMILIES."""
