"""What the data workers' fork server loads once (`data.jpeg_engines`: workers forked from it, not from the
rank): the stream the workers run, and the stop signals left to the rank, as each worker leaves them
(`batches.ignore_stop_signals`), so that a signal to the job's process group does not end the server and
with it the next epoch's workers."""

from fsdpclip.data import stream  # noqa: F401  (loaded once, in the server)
from fsdpclip.data.batches import ignore_stop_signals

ignore_stop_signals(0)
