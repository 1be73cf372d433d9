"""Sharding a built model: the process group and meshes, FSDP2 and CUDA graphs."""
