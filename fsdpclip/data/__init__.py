"""Training data: webdataset and synthetic batches, tar shards, the image transform, shards written, demo data."""
