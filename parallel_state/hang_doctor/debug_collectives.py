"""`--debug-collectives`: before each collective the ranks of its group check that they make
the same call, and raise a clear error instead of hanging or reducing the wrong tensors.

A consumer of parallel_state.collectives. Before every observed group collective, each rank
all-gathers (over the same group, with torch directly) a fixed-size fingerprint: the call's
signature (op, reduce op / root, dtype, shapes) and its Python call site. If any two ranks
differ, every rank raises `CollectiveMismatchError` naming the ranks, their calls and sites,
before the real collective runs, so the group stays usable and nothing hangs. For a p2p batch
each sender first sends its message's dtype/shape and call site to the receiver, which raises
if they differ from what it expects to receive (the sender then fails when the receiver's
process exits). A send whose receive never comes still waits for the timeout: the hang
doctor's trace reports it.

Cost: one all-gather of FINGERPRINT_BYTES per rank before each collective (latency-bound:
it doubles the number of collectives) and one extra message per p2p message; measured in
docs/guide/hang-doctor.md. A debugging mode, off by default.

Call sites are part of the check: SPMD code calls each collective from the same line on
every rank of a group. Code that legitimately calls one collective from different lines on
different ranks (`if rank == 0: broadcast(x) else: broadcast(y)`) is reported as a mismatch;
call it from one line.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives

FINGERPRINT_BYTES = 512
_active: "DebugCollectives | None" = None


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group are about to make different collectives (or p2p messages)."""


def _encode(text: str, device) -> torch.Tensor:
    data = text.encode()[:FINGERPRINT_BYTES].ljust(FINGERPRINT_BYTES, b"\0")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(t: torch.Tensor) -> str:
    return t.cpu().numpy().tobytes().rstrip(b"\0").decode(errors="replace")


def _device(call: collectives.Call) -> torch.device:
    tensors = call.tensors or [m.tensor for m in call.messages or ()]
    if tensors:
        return tensors[0].device
    if dist.get_backend(call.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _site(call: collectives.Call) -> str:
    return " < ".join(call.site) or "(no Python call site)"


class DebugCollectives(collectives.Consumer):
    needs_site = True

    def start(self, call: collectives.Call) -> None:
        if call.messages is not None:
            self._check_p2p(call)
        elif dist.get_world_size(call.group) > 1:
            self._check_group(call)

    def end(self, call, error) -> None:
        pass

    @staticmethod
    def _check_group(call: collectives.Call) -> None:
        n, device = dist.get_world_size(call.group), _device(call)
        mine = _encode(f"{call.signature()}\t{_site(call)}", device)
        everyone = torch.empty(n * FINGERPRINT_BYTES, dtype=torch.uint8, device=device)
        collectives._all_gather_single(everyone, mine, group=call.group)
        data = everyone.cpu().numpy().tobytes()
        texts = [data[i * FINGERPRINT_BYTES:(i + 1) * FINGERPRINT_BYTES].rstrip(b"\0")
                 .decode(errors="replace") for i in range(n)]
        if len(set(texts)) == 1:
            return
        ranks = call.ranks
        calls = {}
        for rank, text in zip(ranks, texts):
            calls.setdefault(text, []).append(rank)
        detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: "
                           f"{text.replace(chr(9), ' at ')}" for text, rs in calls.items())
        raise CollectiveMismatchError(
            f"--debug-collectives: the ranks of group {call.label} {list(ranks)} disagree at "
            f"its collective #{call.seq}: {detail}. Every rank of a group must make the same "
            f"collectives, from the same place, in the same order, with the same shapes and "
            f"dtype")

    @staticmethod
    def _check_p2p(call: collectives.Call) -> None:
        ops, incoming = [], []
        for m in call.messages:
            if m.kind == "send":
                fp = _encode(f"{collectives.tensor_desc(m.tensor)}\t{_site(call)}",
                             m.tensor.device)
                ops.append(dist.P2POp(dist.isend, fp, m.peer, group=call.group, tag=m.tag))
            else:
                buf = torch.empty(FINGERPRINT_BYTES, dtype=torch.uint8, device=m.tensor.device)
                incoming.append((m, buf))
                ops.append(dist.P2POp(dist.irecv, buf, m.peer, group=call.group, tag=m.tag))
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        me = dist.get_rank()
        for m, buf in incoming:
            theirs, _, their_site = _decode(buf).partition("\t")
            expected = collectives.tensor_desc(m.tensor)
            if theirs != expected:
                raise CollectiveMismatchError(
                    f"--debug-collectives: p2p message #{m.seq} from rank {m.peer} to rank "
                    f"{me} (tag {m.tag}): rank {m.peer} sends {theirs} at {their_site}, but "
                    f"rank {me} expects {expected} at {_site(call)}. Both sides of a pipeline "
                    f"exchange must agree on the shapes and dtype (the TensorSpec)")


def enable() -> None:
    """Check every collective from now on (call on every rank, at the same point)."""
    global _active
    if _active is None:
        _active = DebugCollectives()
        collectives.add_consumer(_active)


def disable() -> None:
    global _active
    if _active is not None:
        collectives.remove_consumer(_active)
        _active = None
