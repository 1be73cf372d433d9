"""One rank's training: the Trainer and its loop, and the parts it holds (the plan and the sharded model, the batch
search, the data feed, checkpoints, evaluation, stops, the loss, the metrics)."""
