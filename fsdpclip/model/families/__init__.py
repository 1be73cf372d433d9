"""Tower families: one module each, registered in fsdpclip.spec.registry.TOWER_FAMILIES."""
