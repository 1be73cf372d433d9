"""The entry points: rendering, running and submitting jobs (torchrun locally, sbatch under Slurm, a hostfile's hosts
over ssh) and the rank entry torchrun starts. No torch at import."""
