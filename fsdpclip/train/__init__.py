"""One rank's training: the rank entry, the Trainer and its loop, the optimizer, the loss and the metrics."""
