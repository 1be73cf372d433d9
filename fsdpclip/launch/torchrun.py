"""torchrun, quiet about the trainer's deliberate endings.

    python -m fsdpclip.launch.torchrun TORCHRUN-ARGS...     (what `fsdpclip launch` and its Slurm script run)

torchrun reports every non-zero exit of a rank with a Python traceback (ChildFailedError). When the
ranks ended on purpose (preempted and checkpointed, stopped on a non-finite step, or unable to start:
the codes of fsdpclip.launch.entry, whose message is in RUN_DIR/exit.json), this exits with that code and no
traceback, and without torchrun's `failed (exitcode: 75)` line; ranks that torchrun itself stopped with
SIGTERM once the first of them had ended count as ending with it. A rank killed by a signal (SIGKILL from the
kernel's out-of-memory killer or a user) cannot say so itself: this records it for the launcher's last line
(RUN_DIR/logs/crash-rank-N.json, `directory.record_killed_rank`) and exits 1 without a traceback. Any other
failure is torchrun's own report, unchanged. Ranks it forked (--run-path --start-method=fork) get the same:
their exit code, without the traceback of torchrun's own wait for them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from fsdpclip.run.directory import EXIT_CRASH, EXIT_NONFINITE, EXIT_NO_SPACE, EXIT_PREEMPTED, EXIT_SPEC, JOB_FILE
from fsdpclip.run.reports import record_killed_rank

DELIBERATE = {EXIT_SPEC, EXIT_NONFINITE, EXIT_NO_SPACE, EXIT_PREEMPTED}
TORN_DOWN = -signal.SIGTERM  # a rank torchrun stopped after another had exited


class ExitCodeWithoutTraceback(logging.Filter):
    """torchrun logs a forked rank's non-zero exit with a traceback of its own wait for the rank
    (ProcessExitedException), which adds nothing to the exit code it logs: drop that traceback, as for
    ranks it ran as new interpreters. A rank's own exception (ProcessRaisedException) keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from torch.multiprocessing.spawn import ProcessExitedException

        if record.exc_info and isinstance(record.exc_info[1], ProcessExitedException):
            record.exc_info, record.exc_text = None, None
        return True


class DeliberateExitsUnlogged(logging.Filter):
    """torchrun logs a rank's exit with any non-zero code as an error (`E… failed (exitcode: 75) local_rank: 0`):
    for the trainer's deliberate endings (a preemption, a stop) that line is noise before fsdpclip's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (str(record.msg).startswith("failed (exitcode: %s)") and isinstance(record.args, tuple)
                    and record.args and record.args[0] in DELIBERATE)


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    torchrun_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_log.addFilter(ExitCodeWithoutTraceback())
    torchrun_log.addFilter(DeliberateExitsUnlogged())
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its banner about it
    try:
        torchrun()
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()} - {TORN_DOWN}
        if len(codes) == 1 and codes <= DELIBERATE:
            return codes.pop()
        killed = {rank: signal.Signals(-failure.exitcode).name for rank, failure in exc.failures.items()
                  if failure.exitcode < 0 and failure.exitcode != TORN_DOWN}
        job_file = Path(sys.argv[-1])
        if killed and job_file.name == JOB_FILE:  # torchrun's last argument: the ranks' RUN_DIR/job.json
            for rank, name in killed.items():
                record_killed_rank(job_file.parent, rank, name)
            return EXIT_CRASH
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
