"""Building OpenCLIP models: towers, freeze and decay groups, weights, published tags, faster modules."""
