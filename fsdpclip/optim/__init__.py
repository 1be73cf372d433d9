"""The optimizer step's state: AdamW on local shards and its schedule, and the moving average of the weights."""
