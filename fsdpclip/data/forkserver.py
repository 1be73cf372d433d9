"""What the data workers' fork server loads once (`engines.worker_context`), so that no worker imports it at
each epoch's start: the stream the workers run, and OpenCLIP, whose tokenizers and transforms each worker
unpickles, without transformers and wandb, as the ranks import it where no Hugging Face tower is used and no W&B
logging (the workers of a Hugging Face tokenizer import transformers themselves; no worker logs to W&B)."""

from fsdpclip.data import stream  # noqa: F401
from fsdpclip.model.build import without_modules

with without_modules(("transformers", "wandb")):
    import open_clip  # noqa: F401
