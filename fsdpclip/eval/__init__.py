"""The eval tasks (zero-shot classification, retrieval, a validation loss) and a checkpoint evaluated."""
