"""The foundations: the job spec and what reads it (job files, the starter spec, what a relaunch may change), the
registries of the pluggable concerns with their protocols, the problems every layer reports, shard URLs. No torch."""
