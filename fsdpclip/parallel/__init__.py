"""Sharding a built model: the process group and meshes, the plan of FSDP units, FSDP2 and CUDA graphs."""
