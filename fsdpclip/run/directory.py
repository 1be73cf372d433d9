"""The run directory `<output_dir>/<name>/`: the files that describe one run, the lock that makes it one
job's, and how each launch ended.

    job.json       the resolved spec the ranks train from (absolute paths)
    plan.json      every 'auto' of that spec as this launch settled it (`plan.resolved.RunPlan`)
    launches/      every start's resolved spec and what it changed against the checkpoint it resumed
    metrics.jsonl  what the trainer logged
    checkpoints/   sharded checkpoints (fsdpclip.checkpoint.sharded)
    exit.json      how the last launch ended: code, message, step, checkpoint
    lock           who runs in it now: the processes of the job (pid and start time), host, since; refreshed
                   while it runs
    .lock.guard    what a process holds (flock) while it reads and replaces the lock
    stop           a request to checkpoint and stop, from `fsdpclip launch` or the Slurm script
    logs/          Slurm's and each node's output; a report from each rank that crashed
    wandb-id       the Weights & Biases run this run logs to (a relaunch continues it)
    wandb/         that W&B run's local files (unless WANDB_DIR puts them elsewhere)
    compile-cache.bin  torch.compile's artifacts of the first compiled step, loaded by later launches
    auto_batch.json  the per-GPU batch `batch.per_gpu: "auto"` chose, its probes and search time (reused by a relaunch)
    imported.json  the open_clip_train checkpoint the run continues, and what the spec changes (`fsdpclip import`)

Its names and exit codes are here; the lock in `run.lock`, stop requests and exit reports in `run.reports`, the
files' handling in `run.files`. Names alone, no torch: the launcher imports it before any rank starts.
"""

from __future__ import annotations

JOB_FILE, EXIT_FILE, LOG_DIR, LAUNCHES = "job.json", "exit.json", "logs", "launches"
LOCK_FILE, STOP_FILE = "lock", "stop"
WANDB_ID_FILE, IMPORT_FILE, AUTO_BATCH_FILE, PLAN_FILE = "wandb-id", "imported.json", "auto_batch.json", "plan.json"
# How a run ends (the trainer's exit code, in exit.json): fsdpclip.launch.entry says when each is used.
EXIT_OK, EXIT_CRASH, EXIT_SPEC, EXIT_NONFINITE, EXIT_NO_SPACE, EXIT_PREEMPTED = 0, 1, 2, 65, 74, 75
EXIT_STOPPED_AT_ONCE = 130  # a second Ctrl-C or SIGTERM to `fsdpclip launch`: stopped without a checkpoint
# When `fsdpclip launch` started the job (seconds since the epoch), for time-to-first-step.
LAUNCH_TIME_ENV = "FSDPCLIP_LAUNCH_TIME"
# The lock token of the launch that started the ranks (they hold the lock through it).
LOCK_TOKEN_ENV = "FSDPCLIP_LOCK_TOKEN"
LOCK_GUARD = ".lock.guard"
# The launcher of this node's ranks, as "pid:start ticks": they stop (checkpoint, exit 75) once it is gone.
LAUNCHER_ENV = "FSDPCLIP_LAUNCHER"
LOCK_REFRESH_S = 30
# A lock of another host is stale once it has not been refreshed for this long (its job died with
# its node); on the same host the holder's pid tells at once.
LOCK_STALE_S = 600

