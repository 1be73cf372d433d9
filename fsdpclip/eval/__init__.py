"""Zero-shot classification and image-text retrieval."""
