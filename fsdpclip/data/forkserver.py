"""What the data workers' fork server loads once (`engines.worker_context`), so that no worker imports it at
each epoch's start: the stream the workers run, and OpenCLIP, whose tokenizers and transforms each worker
unpickles, without transformers, as the ranks import it where no Hugging Face tower is used (the workers of a
Hugging Face tokenizer import transformers themselves)."""

from fsdpclip.data import stream  # noqa: F401
from fsdpclip.model.build import without_modules

with without_modules(("transformers",)):
    import open_clip  # noqa: F401
