"""fsdpclip: train OpenCLIP models with PyTorch FSDP2 from one JSON job spec."""

__version__ = "0.1.0"
