"""Runs `fsdpclip.launch.entry` under torchrun with one fault injected, then exits with its code.

    faults.py JOB signal:RANK:STEP       RANK sends itself SIGUSR1 after STEP
    faults.py JOB slow:SECONDS           every step of every rank takes SECONDS longer
    faults.py JOB eval-crash             every rank's first evaluation fails on its first batch (its data workers running)
    faults.py JOB nan:STEP               the loss of STEP is NaN on every rank
    faults.py JOB crash-save:RANK:NTH    RANK is killed (SIGKILL) in its NTH checkpoint save
    faults.py JOB stale-latest:RANK:STEP RANK sees checkpoint STEP as the latest (a lagging filesystem cache)
    faults.py JOB slow-write:SECONDS     every background checkpoint write takes SECONDS longer (a slow disk)
    faults.py JOB fail-write:RANK        RANK's background checkpoint writes fail (DCP tells every rank)
    faults.py JOB die-upload:NTH         rank 0 is killed (SIGKILL) in its NTH upload (checkpoint.remote), after the
                                         checkpoint's data files, before its meta.json and `latest`
    faults.py JOB damage-rank-state:RANK RANK halves its state file in the checkpoint chosen to resume from, after
                                         rank 0 checked it (a filesystem damaging it between the check and the load)
    faults.py JOB fill-disk:STEP         after STEP, another writer fills the run directory's disk just before rank 0
                                         appends a metrics record that does not fit in metrics.jsonl's last block
Several at once: FAULT+FAULT.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time

import torch

from fsdpclip.checkpoint import layout, remote, sharded as checkpoint, staging
from fsdpclip.jobspec.jobfile import load_job
from fsdpclip.launch import entry as train
from fsdpclip.train import evaluating, metrics, trainer


def main(job: str, faults: str) -> int:
    for fault in faults.split("+"):
        inject(fault, int(os.environ["RANK"]), job)
    return train.main([job])


def inject(fault: str, rank: int, job: str) -> None:
    kind, *args = fault.split(":")
    if kind == "slow":
        seconds, step = float(args[0]), trainer.Trainer.train_step

        def slow_step(self, window):
            time.sleep(seconds)
            return step(self, window)

        trainer.Trainer.train_step = slow_step
    elif kind == "eval-crash":
        evaluate = evaluating.Evaluator.evaluate

        def failing_evaluate(self):
            def encode_image(*args, **kwargs):
                raise RuntimeError("out of memory in the evaluation (injected)")

            self.model.encode_image = encode_image
            return evaluate(self)

        evaluating.Evaluator.evaluate = failing_evaluate
    elif kind == "signal":
        target, at = int(args[0]), int(args[1])
        step = trainer.Trainer.train_step

        def train_step(self, window):
            out = step(self, window)
            if self.progress.step == at and rank == target:
                os.kill(os.getpid(), signal.SIGUSR1)
            return out

        trainer.Trainer.train_step = train_step
    elif kind == "nan":
        at = int(args[0])
        build = trainer.build_loss

        def build_loss(spec, rank_, world):
            loss_fn = build(spec, rank_, world)
            calls = [0]

            def poisoned(*outputs):
                calls[0] += 1
                loss = loss_fn(*outputs)
                return loss * torch.tensor(float("nan")) if calls[0] == at else loss

            return poisoned

        trainer.build_loss = build_loss
    elif kind == "crash-save":
        target, nth = int(args[0]), int(args[1])
        write = checkpoint.Checkpointer._write_rank_state
        calls = [0]

        def write_rank_state(self, partial, state):
            calls[0] += 1
            if rank == target and calls[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, partial, state)

        checkpoint.Checkpointer._write_rank_state = write_rank_state
    elif kind == "slow-write":
        seconds, write = float(args[0]), checkpoint.write_staged

        def slow_write(*args_, **kwargs):
            time.sleep(seconds)
            return write(*args_, **kwargs)

        checkpoint.write_staged = slow_write
    elif kind == "fail-write":
        target, write = int(args[0]), staging.write_dcp

        class FailingWriter(staging.FileSystemWriter):
            def write_data(self, plan, planner):
                raise OSError("the disk went away (injected)")

        def failing_write(state, checkpoint_id, group=None):
            if rank != target:
                return write(state, checkpoint_id, group)
            staging.dcp.save(state, storage_writer=FailingWriter(checkpoint_id), process_group=group)

        staging.write_dcp = failing_write
    elif kind == "die-upload":
        nth, put = int(args[0]), remote.RemoteFolder.put
        calls = [0]

        def dying_put(self, files, checkpoint_dir):
            calls[0] += 1
            put(self, files, checkpoint_dir)
            if calls[0] == 2 * nth - 1:  # each upload puts its data files, then meta.json
                os.kill(os.getpid(), signal.SIGKILL)

        remote.RemoteFolder.put = dying_put
    elif kind == "stale-latest":
        target, step = int(args[0]), int(args[1])
        if rank == target:
            layout.latest_checkpoint = lambda run_dir: layout.Path(run_dir) / layout.CHECKPOINTS / layout.checkpoint_name(step)
    elif kind == "damage-rank-state":
        target, candidates = int(args[0]), checkpoint.Checkpointer.resume_candidates

        def damaging(self):
            chosen = candidates(self)
            if rank == target and chosen:
                state = layout.rank_file(chosen[0], rank)
                state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
            return chosen

        checkpoint.Checkpointer.resume_candidates = damaging
    elif kind == "fill-disk":
        after, write, run_dir = int(args[0]), metrics.MetricsLog.write, load_job(job).run_dir
        log_file, filler = run_dir / "metrics.jsonl", run_dir.parent / "filler"

        def write_onto_a_full_disk(self, record):
            block, size = os.statvfs(log_file).f_bsize, log_file.stat().st_size
            torn = 0 < -size % block < len(json.dumps(record)) + 1  # the record needs a block the disk lacks
            if rank == 0 and record.get("step", 0) > after and torn and not filler.exists():
                with open(filler, "wb", buffering=0) as file, contextlib.suppress(OSError):
                    while file.write(b"\0" * block):
                        pass
            return write(self, record)

        metrics.MetricsLog.write = write_onto_a_full_disk


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
