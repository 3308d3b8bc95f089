"""Deliberately broken distributed programs for tests/test_hang_doctor.py.

    torchrun --standalone --nproc-per-node 2 tests/hang_programs.py CASE LOG_DIR \
        [--timeout-s 3] [--debug-collectives] [--tp 1] [--pp 1]

Each builds the shardzoo grid on gloo with the given operation timeout, starts the collective
trace in LOG_DIR/hang, runs CASE inside `dump_on_error`, then meets the others at a final
barrier, as train.py does. Cases (two ranks unless said):

- skip_all_reduce: rank 1 skips the gradient all-reduce of step 1 (dp = 2) and goes on to
  the next step's batch broadcast;
- shape_mismatch: the ranks all-reduce tensors of different shapes (gloo aborts a process);
- unmatched_send (pp = 2): stage 0 sends two microbatches, stage 1 receives one;
- rank_dies: rank 1 raises in the middle of step 1;
- rank_killed: rank 1 is SIGKILLed in the middle of step 1;
- wait_for_go: rank 0 waits in an all-reduce until LOG_DIR/go exists (rank 1 joins then);
  the test sends SIGUSR1 meanwhile.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import parallel_state as ps  # noqa: E402
from parallel_state import collectives, p2p  # noqa: E402
from parallel_state.hang_doctor import debug_collectives, trace  # noqa: E402


def next_batch(step: int) -> torch.Tensor:
    """Rank 0 reads the batch and broadcasts it (a data loader on one rank)."""
    batch = torch.full((4, 4), float(step))
    collectives.broadcast(batch, src=0, group=ps.get_data_parallel_group())
    return batch


def sync_grads(model: torch.nn.Module) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    collectives.all_reduce(flat, group=ps.get_data_parallel_group())


def train_steps(steps: int = 3, skip=None, die=None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    rank = torch.distributed.get_rank()
    for step in range(steps):
        model.zero_grad()
        loss = model(next_batch(step)).sum()
        if die == (rank, step):
            raise RuntimeError(f"simulated failure on rank {rank} at step {step}")
        loss.backward()
        if skip != (rank, step):
            sync_grads(model)


def skip_all_reduce(args) -> None:
    train_steps(skip=(1, 1))  # the bug: rank 1 skips one gradient sync


def rank_dies(args) -> None:
    train_steps(die=(1, 1))


def rank_killed(args) -> None:
    if torch.distributed.get_rank() == 1:
        train_steps(steps=1)
        os.kill(os.getpid(), signal.SIGKILL)
    train_steps(steps=2)


def shape_mismatch(args) -> None:
    rank = torch.distributed.get_rank()
    x = torch.ones(8 if rank == 0 else 6)  # the bug: a rank-dependent length
    collectives.all_reduce(x, group=ps.get_data_parallel_group())


def unmatched_send(args) -> None:
    spec = p2p.TensorSpec(shapes=((8, 2, 16),), dtype=torch.float32, device=torch.device("cpu"))
    if ps.is_pipeline_first_stage():
        for _ in range(2):
            p2p.send_forward(spec, (torch.ones(8, 2, 16),))
    else:
        p2p.recv_forward(spec)  # the bug: one receive for two microbatches


def wait_for_go(args) -> None:
    go = os.path.join(args.log_dir, "go")
    if torch.distributed.get_rank() == 1:
        while not os.path.exists(go):
            time.sleep(0.05)
    collectives.all_reduce(torch.ones(3), group=ps.get_data_parallel_group())


CASES = {f.__name__: f for f in (skip_all_reduce, shape_mismatch, unmatched_send, rank_dies,
                                 rank_killed, wait_for_go)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("log_dir")
    p.add_argument("--timeout-s", type=float, default=3.0)
    p.add_argument("--debug-collectives", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(1)
    ps.initialize_distributed("cpu", timeout=timedelta(seconds=args.timeout_s))
    ps.initialize_model_parallel(args.tp, args.pp, device="cpu")
    trace.start_trace(args.log_dir)
    if args.debug_collectives:
        debug_collectives.enable()
    with trace.dump_on_error():
        CASES[args.case](args)
        collectives.barrier()
    trace.stop_trace()
    print(f"rank {torch.distributed.get_rank()}: {args.case} finished", flush=True)
    ps.destroy_model_parallel(destroy_world=True)


if __name__ == "__main__":
    main()
