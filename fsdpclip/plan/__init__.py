"""The mesh rules and the models of `fsdpclip plan`: shard degrees, traffic, step time, memory per GPU."""
