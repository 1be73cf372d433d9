"""torchrun, quiet about the trainer's deliberate endings.

    python -m fsdpclip.torchrun TORCHRUN-ARGS...     (what `fsdpclip launch` and its Slurm script run)

torchrun reports every non-zero exit of a rank with a Python traceback (ChildFailedError). When the
ranks ended on purpose (preempted and checkpointed, stopped on a non-finite step, or unable to start:
the codes of fsdpclip.train, whose message is in RUN_DIR/exit.json), this exits with that code and no
traceback; ranks that torchrun itself stopped with SIGTERM once the first of them had ended count as
ending with it. Any other failure is torchrun's own report, unchanged.
"""

from __future__ import annotations

import signal
import sys

from fsdpclip.rundir import EXIT_NONFINITE, EXIT_PREEMPTED, EXIT_SPEC

DELIBERATE = {EXIT_SPEC, EXIT_NONFINITE, EXIT_PREEMPTED}
TORN_DOWN = -signal.SIGTERM  # a rank torchrun stopped after another had exited


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()} - {TORN_DOWN}
        if len(codes) == 1 and codes <= DELIBERATE:
            return codes.pop()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
