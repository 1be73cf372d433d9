"""Rendering, running and submitting jobs: torchrun locally, sbatch under Slurm. No torch at import."""
