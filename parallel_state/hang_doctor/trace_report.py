"""Reads the hang doctor's rank files (trace.py) and says where the ranks disagree.

`report(directory)` returns the text `tools/hang_report.py` prints: one paragraph per
finding, the first point of disagreement first, then the evidence per rank. Findings:

- a rank missing from a collective the others are blocked in, and where it is instead;
- ranks of one group making different calls at the same position (op, shapes, dtype or call
  site differ: mismatched shapes, or a skipped / extra collective);
- a p2p send whose receive was never posted (or a receive without a send), or a message
  whose sender and receiver disagree on shape / dtype;
- a rank that exited: with an exception, by a crash (fatal signal), killed without a trace
  (SIGKILL, the OOM killer, os._exit), or normally while others still wait.

Calls are matched by position, not time: the k-th collective on a group on one rank meets
the k-th on every other member (`seq`), and the k-th message of a (sender, receiver, tag)
channel meets the k-th on the other side. The ring file (rank-K.ring) gives the newest
calls; rank-K.txt adds why the rank dumped, its error and its Python stacks; rank-K.crash
holds faulthandler's output after a fatal signal.
"""
from __future__ import annotations

import json
import os
import re
import socket
import time
from collections import defaultdict
from dataclasses import dataclass, field

HEADER_BYTES = 64 * 1024  # as trace.py writes them (not imported: this module reads only)
MOVING_S = 1.0  # a call in flight for less than this is taken as still moving (a snapshot)
_MESSAGE = re.compile(r"(send|recv)([<>])(\d+) tag (\d+) #(\d+) (\S+)")


@dataclass
class Record:
    """One traced call (a ring line)."""

    status: str  # R in flight, D done, E raised
    t_end: float | None
    index: int
    t_start: float
    thread: str
    group: str
    seq: int
    signature: str
    sites: list[str]

    @property
    def op(self) -> str:
        return self.signature.split(" ", 1)[0]

    @property
    def site(self) -> str:
        return self.sites[0] if self.sites else "(no Python call site)"

    @property
    def is_p2p(self) -> bool:
        return self.op == "batch_isend_irecv"

    def messages(self) -> list[tuple[str, int, int, int, str]]:
        """p2p messages as (kind, peer, tag, seq, "dtype[shape]")."""
        return [(k, int(p), int(t), int(n), d)
                for k, _, p, t, n, d in _MESSAGE.findall(self.signature.replace(", ", ","))]


def parse_line(line: str) -> Record | None:
    parts = line.rstrip("\n").rstrip().split("\t")
    if len(parts) < 7 or not parts[0] or parts[0][0] not in "RDE" or not parts[1].isdigit():
        return None
    end = parts[0][1:].strip()
    try:
        return Record(parts[0][0], None if end == "-" else float(end), int(parts[1]),
                      float(parts[2]), parts[3], parts[4], int(parts[5]), parts[6],
                      parts[7].split(" < ") if len(parts) > 7 and parts[7] else [])
    except ValueError:
        return None


@dataclass
class RankTrace:
    """What one rank left: header, calls (oldest first), and its dump if it wrote one."""

    rank: int
    header: dict
    records: list[Record]
    reasons: list[str] = field(default_factory=list)
    error: str = ""
    stacks: str = ""
    crash: str = ""
    files: list[str] = field(default_factory=list)
    alive: bool | None = None  # None: on another host (unknown)

    @property
    def wrapped(self) -> bool:
        return len(self.records) >= self.header.get("slots", 1 << 60)

    def label(self, group: str) -> str:
        g = self.header.get("groups", {}).get(group, {})
        return g.get("label") or f"group {group}"

    @property
    def blocked(self) -> Record | None:
        """The last call if it raised, else the newest call still in flight (an async one
        may be older than later calls), else None."""
        if self.records and self.records[-1].status == "E":
            return self.records[-1]
        return next((r for r in reversed(self.records) if r.status == "R"), None)

    @property
    def exception(self) -> str | None:
        for reason in self.reasons:
            text = reason.split(" ", 1)[-1]
            if text.startswith("exception:"):
                return text[len("exception:"):].strip()
        return None

    def exit_state(self) -> tuple[str, float] | None:
        """How the process ended, if it did: (description, time)."""
        if self.crash.strip():
            first = self.crash.strip().splitlines()[0]
            frame = _innermost_frame(self.crash)
            return (f"crashed ({first.rstrip('.')}{f', in {frame}' if frame else ''})",
                    self.header.get("updated", 0.0))
        exc = self.exception
        if exc is not None:
            where = _traceback_site(self.error)
            return (f"exited with {exc}{f' (raised at {where})' if where else ''}",
                    _reason_time(self.reasons, "exception:"))
        if self.header.get("state") == "exited" and not self.reasons:
            return "exited normally", self.header.get("updated", 0.0)
        if self.alive is False and not self.reasons:
            last = self.records[-1].t_start if self.records else self.header.get("started", 0)
            return ("was killed without a chance to write a dump (SIGKILL, the OOM killer or "
                    "os._exit: the process is gone)", last)
        return None


def _reason_time(reasons: list[str], prefix: str) -> float:
    for reason in reasons:
        t, _, text = reason.partition(" ")
        if text.startswith(prefix):
            return float(t)
    return 0.0


def _frames(stack_text: str) -> list[str]:
    return re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stack_text)


def _short(path: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, root) if path.startswith(os.path.join(root, "")) else path


def _is_library(path: str) -> bool:
    return any(s in path for s in (f"{os.sep}torch{os.sep}", "site-packages", f"{os.sep}lib"
                                   f"{os.sep}python3", f"{os.sep}parallel_state{os.sep}"))


def _innermost_frame(stack_text: str) -> str | None:
    """First user frame of the first thread block of a faulthandler dump."""
    for path, line, func in _frames(stack_text.split("\n\n")[0] if stack_text else ""):
        if not _is_library(path):
            return f"{_short(path)}:{line} ({func})"
    return None


def _traceback_site(tb: str) -> str | None:
    """Innermost user frame of a Python traceback text."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', tb)
    for path, line, func in reversed(frames):
        if not _is_library(path):
            return f"{_short(path)}:{line} ({func})"
    return None


def _thread_sites(stacks: str) -> list[str]:
    """Per Python thread (faulthandler dump), its innermost user frame, skipping the hang
    doctor's own watchdog."""
    out = []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks):
        frames = _frames(block)
        if not frames or any(f[0].endswith(os.path.join("hang_doctor", "trace.py"))
                             and f[2] in ("_watch", "_handle_signal") for f in frames):
            continue
        user = [f for f in frames if not _is_library(f[0])]
        head = user[0] if user else frames[0]
        out.append(f"{_short(head[0])}:{head[1]} ({head[2]})")
    return out


# ---------------------------------------------------------------------------- loading
def _read_ring(path: str) -> tuple[dict, list[Record]]:
    with open(path, "rb") as f:
        data = f.read()
    header = json.loads(data[:HEADER_BYTES].decode(errors="replace").strip() or "{}")
    size = header.get("slot_bytes", 512)
    records = []
    for off in range(HEADER_BYTES, len(data), size):
        rec = parse_line(data[off: off + size].decode(errors="replace"))
        if rec is not None:
            records.append(rec)
    return header, sorted(records, key=lambda r: r.index)


def _read_dump(path: str) -> dict:
    out = {"header": {}, "reasons": [], "error": "", "calls": [], "stacks": ""}
    section = None
    for line in open(path, errors="replace").read().splitlines():
        if line.startswith("header "):
            out["header"] = json.loads(line[len("header "):])
        elif line.startswith("== "):
            section = line[3:].split(" ", 1)[0]
        elif section == "reasons" and line.strip():
            out["reasons"].append(line)
        elif section == "error":
            out["error"] += line + "\n"
        elif section == "calls":
            rec = parse_line(line)
            if rec is not None:
                out["calls"].append(rec)
        elif section == "python":
            out["stacks"] += line + "\n"
    return out


def read_header(ring_path: str) -> dict | None:
    """The JSON header of a ring file, or None if it cannot be read (yet)."""
    try:
        with open(ring_path, "rb") as f:
            return json.loads(f.read(HEADER_BYTES).decode(errors="replace").strip() or "{}")
    except (OSError, ValueError):
        return None


def alive(header: dict) -> bool | None:
    """Whether the header's process still runs; None when it ran on another host."""
    if header.get("host") != socket.gethostname() or "pid" not in header:
        return None
    try:
        os.kill(header["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load(directory: str) -> tuple[dict[int, RankTrace], list[str]]:
    """The traces of the newest run found in `directory`, by rank; notes on skipped files."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} does not exist; pass the hang/ folder inside "
                                f"the run's --log-dir (e.g. runs/latest/hang)")
    found: dict[int, RankTrace] = {}
    notes: list[str] = []
    names = sorted(os.listdir(directory))
    for name in names:
        m = re.fullmatch(r"rank-(\d+)\.(ring|txt)", name)
        if not m:
            continue
        rank, path = int(m.group(1)), os.path.join(directory, name)
        try:
            if m.group(2) == "ring":
                header, records = _read_ring(path)
                dump = {}
            else:
                dump = _read_dump(path)
                header, records = dump["header"], dump["calls"]
        except (OSError, ValueError) as e:
            notes.append(f"{name}: unreadable ({e})")
            continue
        t = found.get(rank)
        if t is None:
            t = found[rank] = RankTrace(rank, header, records)
        elif m.group(2) == "ring":  # the ring is newer than any dump of the same process
            t.header, t.records = header, records
        if dump:
            t.reasons, t.error, t.stacks = dump["reasons"], dump["error"], dump["stacks"]
            if not t.records:
                t.records = records
        t.files.append(name)
    for rank, t in found.items():
        crash = os.path.join(directory, f"rank-{rank}.crash")
        if os.path.exists(crash):
            t.crash = open(crash, errors="replace").read()
        t.alive = alive(t.header)
    runs = {t.header.get("run") for t in found.values()}
    if len(runs) > 1:
        newest = max(found.values(), key=lambda t: t.header.get("started", 0)).header.get("run")
        stale = sorted(r for r, t in found.items() if t.header.get("run") != newest)
        notes.append(f"ignored files of ranks {stale} from an earlier launch")
        found = {r: t for r, t in found.items() if t.header.get("run") == newest}
    return found, notes


# ---------------------------------------------------------------------------- analysis
@dataclass
class Finding:
    """One paragraph of the report. Findings sort by `priority`, then time: calls that
    disagree (0), p2p messages without a partner (1), ranks missing from a collective because
    they exited or run elsewhere (2), ranks that exited (3), and last, ranks missing because
    they wait in another call themselves (4: a link of a chain whose cause is listed first).
    Clocks of different hosts are not compared to find the cause."""

    time: float
    priority: int
    text: str
    ranks: list[int]
    explains: set[int] = field(default_factory=set)  # ranks whose whereabouts it describes


def _ago(t: float, now: float) -> str:
    return f"{max(0.0, now - t):.1f} s"


def _where(r: Record, t: RankTrace, now: float) -> str:
    state = {"R": f"waiting for {_ago(r.t_start, now)}",
             "E": f"raised after {(r.t_end or now) - r.t_start:.1f} s",
             "D": "done"}[r.status]
    return (f"{r.op} #{r.seq} of group {t.label(r.group)} at {r.site} ({state})"
            if not r.is_p2p else f"a p2p exchange ({_p2p_desc(r)}) at {r.site} ({state})")


def _p2p_desc(r: Record) -> str:
    return "; ".join(f"{k} {'to' if k == 'send' else 'from'} rank {p} tag {tag} #{n} {d}"
                     for k, p, tag, n, d in r.messages())


def position(t: RankTrace | None, now: float) -> str:
    """Where a rank is: its blocked call, how it ended, or its last call."""
    if t is None:
        return "left no trace file (tracing off, not started, or it finished and removed it)"
    end = t.exit_state()
    blocked = t.blocked
    parts = []
    if blocked is not None:
        parts.append(f"in {_where(blocked, t, now)}")
    elif t.records:
        parts.append(f"past its last traced call, {_where(t.records[-1], t, now)}")
    else:
        parts.append("without any traced call")
    if end is not None:
        parts.append(f"and {end[0]}")
    return " ".join(parts)


def _group_members(traces: dict[int, RankTrace]) -> dict[str, tuple[int, ...]]:
    groups = {}
    for t in traces.values():
        for name, g in t.header.get("groups", {}).items():
            if g.get("ranks"):
                groups[name] = tuple(g["ranks"])
    return groups


def _collective_findings(traces, world: int, now: float) -> list[Finding]:
    out = []
    for group, members in _group_members(traces).items():
        if len(members) < 2:
            continue
        by_rank = {m: {r.seq: r for r in traces[m].records if r.group == group and not r.is_p2p}
                   for m in members if m in traces}
        seqs = sorted({s for recs in by_rank.values() for s in recs})
        for s in seqs:
            present = {m: recs[s] for m, recs in by_rank.items() if s in recs}
            missing = [m for m, recs in by_rank.items() if s not in recs and
                       s > max(recs, default=0) and (recs or not traces[m].wrapped)]
            absent = [m for m in members if m not in traces]
            kinds = defaultdict(list)
            for m, r in present.items():
                kinds[(r.signature, r.site)].append(m)
            first = min(present.values(), key=lambda r: r.t_start)
            label = traces[min(present)].label(group)
            if len(kinds) > 1:
                sigs = {k[0] for k in kinds}
                what = ("tensors of different shapes or dtypes" if len(sigs) > 1 and
                        len({k.split(" ")[0] for k in sigs}) == 1 else
                        "different collectives" if len(sigs) > 1 else
                        "the same collective from different places (a skipped or extra call)")
                calls = "; ".join(f"rank{'s' if len(v) > 1 else ''} {_ranks(v)} "
                                  f"call{'s' * (len(v) == 1)} {sig} at {site}"
                                  for (sig, site), v in kinds.items())
                out.append(Finding(first.t_start, 0, (
                    f"Ranks of group {label} {list(members)} disagree at its collective #{s}: "
                    f"{what}. {calls}.{_skipped(kinds, by_rank, s)} Every rank of a group must "
                    f"make the same collectives in the same order with the same shapes and "
                    f"dtype."), sorted(present)))
                break
            waiting = [m for m, r in present.items() if r.status == "E" or
                       (r.status == "R" and now - r.t_start >= MOVING_S)]
            if missing and waiting:
                r = present[waiting[0]]
                timed = next((" and timed out" if _timed_out(traces[m], r) else " and failed"
                              for m in waiting if present[m].status == "E"), "")
                where = " ".join(f"Rank {m} is {position(traces[m], now)}." for m in missing)
                chained = all(traces[m].blocked is not None and traces[m].exit_state() is None
                              for m in missing)
                out.append(Finding(first.t_start, 4 if chained else 2, (
                    f"Rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} never joined "
                    f"{r.op} #{s} of group {label} {list(members)} ({r.signature}) that "
                    f"rank{'s' if len(waiting) > 1 else ''} {_ranks(waiting)} entered at "
                    f"{r.site}{timed}. {where}"
                    + (f" Ranks {absent} of the group left no trace." if absent else "")),
                    sorted(missing + waiting), set(missing)))
                break
    return out


def _timed_out(t: RankTrace, r: Record) -> bool:
    return any(reason.split(" ", 1)[-1].startswith(f"timeout in {r.op} #{r.seq} ")
               for reason in t.reasons)


def _skipped(kinds: dict, by_rank: dict, s: int) -> str:
    """With two different calls at position s: does one side's call appear earlier in the
    other side's history (then that side skipped it here, or the first side added one)?"""
    if len(kinds) != 2:
        return ""
    (a, ranks_a), (b, ranks_b) = kinds.items()
    for (call, ranks), others in (((a, ranks_a), ranks_b), ((b, ranks_b), ranks_a)):
        before = [n for n, r in by_rank[others[0]].items()
                  if n < s and (r.signature, r.site) == call]
        if before:
            return (f" Rank{'s' if len(others) > 1 else ''} {_ranks(others)} made that "
                    f"{call[0].split(' ')[0]} at {call[1]} before (#{max(before)}) but not "
                    f"here: skipped it (or rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)} "
                    f"made an extra one).")
    return ""


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:-1])) + (" and " if len(ranks) > 1 else "") + str(ranks[-1])


def _p2p_findings(traces, now: float) -> list[Finding]:
    out = []
    # (group, sender, receiver, tag) -> {seq: (record, desc)} for each side
    sent, received = defaultdict(dict), defaultdict(dict)
    for rank, t in traces.items():
        for r in t.records:
            if r.is_p2p:
                for kind, peer, tag, n, desc in r.messages():
                    if kind == "send":
                        sent[(r.group, rank, peer, tag)][n] = (r, desc)
                    else:
                        received[(r.group, peer, rank, tag)][n] = (r, desc)
    for rank, t in traces.items():
        r = t.blocked
        if r is None or not r.is_p2p or (r.status == "R" and now - r.t_start < MOVING_S):
            continue
        for kind, peer, tag, n, desc in r.messages():
            key = (r.group, rank, peer, tag) if kind == "send" else (r.group, peer, rank, tag)
            other = received if kind == "send" else sent
            if peer not in traces:
                continue
            theirs = other.get(key, {})
            count = max(theirs, default=0)
            if n in theirs:
                their_rec, their_desc = theirs[n]
                if their_desc != desc:
                    out.append(Finding(r.t_start, 0, (
                        f"p2p message #{n} from rank {key[1]} to rank {key[2]} (tag {tag}): "
                        f"rank {rank} {'sends' if kind == 'send' else 'expects'} {desc} at "
                        f"{r.site}, rank {peer} {'expects' if kind == 'send' else 'sends'} "
                        f"{their_desc} at {their_rec.site}."), sorted({rank, peer})))
                continue
            if count >= n or (traces[peer].wrapped and not theirs):
                continue
            want, posted = ("receive", "receives from") if kind == "send" else ("send", "sends to")
            last = f", the last at {theirs[count][0].site}" if count else ""
            out.append(Finding(r.t_start, 1, (
                f"Rank {rank}'s p2p {kind} #{n} {'to' if kind == 'send' else 'from'} rank "
                f"{peer} (tag {tag}, {desc}) at {r.site} has no matching {want}: rank {peer} "
                f"has posted {count} {posted} rank {rank} with tag {tag}{last}. "
                f"Rank {peer} is {position(traces[peer], now)}."), sorted({rank, peer}), {peer}))
    return out


def _exit_findings(traces, now: float) -> list[Finding]:
    out = []
    others_wait = {r for r, t in traces.items() if t.blocked is not None}
    for rank, t in traces.items():
        end = t.exit_state()
        if end is None or (end[0] == "exited normally" and not others_wait - {rank}):
            continue
        last = t.records[-1] if t.records else None
        out.append(Finding(end[1], 3, (
            f"Rank {rank} {end[0]}"
            + (f"; its last traced call: {_where(last, t, now)}." if last else ".")),
            [rank]))
    return out


def analyze(traces: dict[int, RankTrace], now: float | None = None) -> list[Finding]:
    """Findings, the first point where ranks disagree first (see `Finding`)."""
    now = time.time() if now is None else now
    world = max((t.header.get("world_size", 0) for t in traces.values()), default=0)
    found = _collective_findings(traces, world, now) + _p2p_findings(traces, now)
    explained = set().union(*(f.explains for f in found))
    found += [f for f in _exit_findings(traces, now) if f.ranks[0] not in explained]
    return sorted(found, key=lambda f: (f.priority, f.time))


def _evidence(t: RankTrace, now: float, calls: int = 4) -> list[str]:
    h = t.header
    alive = {True: "running", False: "gone", None: "on another host"}[t.alive]
    lines = [f"rank {t.rank} (pid {h.get('pid')} on {h.get('host')}, process {alive}; "
             f"files: {', '.join(t.files)})"]
    for reason in t.reasons:
        stamp, _, text = reason.partition(" ")
        lines.append(f"  dumped: {text}")
    if t.crash.strip():
        lines.append(f"  crash: {t.crash.strip().splitlines()[0]}")
    for r in t.records[-calls:]:
        dur = f"{(r.t_end or now) - r.t_start:.3f} s" + ("" if r.t_end else " so far")
        lines.append(f"  {r.status} {t.label(r.group):>10} #{r.seq:<5} {r.signature[:90]}  "
                     f"{dur}  at {' < '.join(r.sites) or '?'}")
    for site in _thread_sites(t.stacks or t.crash)[:3]:
        lines.append(f"  thread stack at {site}")
    return lines


def report(directory: str) -> str:
    """The report text for a hang/ folder (see the module docstring)."""
    traces, notes = load(directory)
    if not traces:
        return f"no rank files (rank-K.ring / rank-K.txt) in {directory}"
    now = time.time()
    world = max(t.header.get("world_size", 0) for t in traces.values())
    timeout = next((t.header.get("timeout_s") for t in traces.values()
                    if t.header.get("timeout_s")), None)
    missing = [r for r in range(world) if r not in traces]
    head = [f"shardzoo hang report for {directory}: world size {world}, files from "
            f"{len(traces)} rank(s)" + (f", none from ranks {missing}" if missing else "")
            + (f"; operation timeout {timeout:g} s" if timeout else "")]
    head += [f"note: {n}" for n in notes]
    findings = analyze(traces, now)
    if not findings:
        head.append("No disagreement found: every group's collectives match on the ranks "
                    "that left a trace, and no p2p message is unmatched.")
    for i, f in enumerate(findings, 1):
        lead = " (the first point where ranks disagree)" if i == 1 and len(findings) > 1 else ""
        head.append(f"\n{i}.{lead} {f.text}")
    head.append("\nEvidence (newest calls last; R in flight, D done, E raised):")
    for rank in sorted(traces):
        head += _evidence(traces[rank], now)
    return "\n".join(head)
