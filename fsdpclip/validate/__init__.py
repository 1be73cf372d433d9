"""What `fsdpclip validate` and `launch` check before anything runs: the spec's problems, its summary, the node."""
