"""Sharded checkpoints (save, find, resume, export) and pickles read without running code."""
