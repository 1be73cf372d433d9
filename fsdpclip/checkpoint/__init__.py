"""Sharded checkpoints: save, find, resume, their copies in object storage, export."""
