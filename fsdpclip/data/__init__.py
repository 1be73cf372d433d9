"""Training data: webdataset and synthetic batches, tar shards, the image transform, shard URLs, demo data."""
