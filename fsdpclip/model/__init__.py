"""The model: building OpenCLIP models, towers, freeze and decay groups, weights, published tags, pickles read
without running code, the plan of FSDP units, float8 layers, faster modules."""
