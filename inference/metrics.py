"""The server's Prometheus metrics (GET /metrics, text exposition format), named as vLLM names
them with the `shardzoo:` prefix, labelled by `model_name` and data-parallel `replica`:

- counters: `request_success_total{finished_reason}` (stop / length / abort),
  `prompt_tokens_total`, `generation_tokens_total`, `request_errors_total{kind}`
  (requests answered with an error body: rejected input, overload, shutdown, replica failure),
  `prefix_cache_queries_total` / `prefix_cache_hits_total` (prompt tokens looked up in / found
  in the prefix cache at admission, vLLM V1's), `num_preemptions_total`;
- gauges: `num_requests_running`, `num_requests_waiting`, `kv_cache_usage_perc` (fraction of
  the replica's KV cache blocks held by requests, 0-1), `prefix_cache_hit_rate` (hits /
  queries so far, 0-1; vLLM V0's `gpu_prefix_cache_hit_rate`), `generation_tokens_per_second`
  (over the last `RATE_WINDOW_S` seconds);
- speculative decoding (only when the engine runs it; vLLM's `spec_decode_*`): counters
  `spec_decode_num_drafts_total` (verified rows that carried drafts),
  `spec_decode_num_draft_tokens_total`, `spec_decode_num_accepted_tokens_total`,
  `spec_decode_num_accepted_tokens_per_pos_total{position}` (drafts accepted at position
  0, 1, ... of their row), gauges `spec_decode_draft_acceptance_rate` (accepted / drafted)
  and `spec_decode_mean_acceptance_length` (tokens emitted per verified row, 1 + accepted /
  drafts), both over the server's life;
- histograms (seconds, but the last): `time_to_first_token_seconds` (arrival at the HTTP layer to the first
  generated token), `inter_token_latency_seconds` (between consecutive events of a request,
  per token), `request_queue_time_seconds` (waiting in the engine before its prefill; a
  request cancelled before it, e.g. its client gave up, counts with the time it waited),
  `e2e_request_latency_seconds`; `request_preemptions` (times a request was preempted, at
  its end, cancelled ones included).

One registry per server (not the process-global one), so tests and several servers in one
process do not share counts.
"""
from __future__ import annotations

import threading
import time
from collections import deque

RATE_WINDOW_S = 10.0
# vLLM's buckets for the latency histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # preemptions of one request
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """Observations of one server, `render()` in Prometheus text format (`content_type`).

    Lives in the API server process: the HTTP thread calls `arrived` / `error`; the thread
    receiving the engines' messages calls `event` (each engine event, with the arrival time
    the frontend kept) and `replica_stats`. Raises ImportError
    naming the extra when prometheus_client is not installed.
    """

    def __init__(self, model_name: str, dp: int):
        try:
            import prometheus_client as pc
        except ImportError as e:
            raise ImportError("the server's /metrics needs prometheus_client: pip install "
                              "'shardzoo[serve]'") from e
        self._pc = pc
        self.registry = reg = pc.CollectorRegistry(auto_describe=True)
        self.content_type = pc.CONTENT_TYPE_LATEST
        labels = ("model_name", "replica")
        p = "shardzoo:"
        self.success = pc.Counter(p + "request_success", "Requests finished, by finish reason",
                                  labels + ("finished_reason",), registry=reg)
        self.errors = pc.Counter(p + "request_errors", "Requests answered with an error body",
                                 ("model_name", "kind"), registry=reg)
        self.prompt_tokens = pc.Counter(p + "prompt_tokens", "Prompt tokens of admitted "
                                        "requests", labels, registry=reg)
        self.generation_tokens = pc.Counter(p + "generation_tokens", "Generated tokens",
                                            labels, registry=reg)
        self.running = pc.Gauge(p + "num_requests_running", "Requests in the running batch",
                                labels, registry=reg)
        self.waiting = pc.Gauge(p + "num_requests_waiting", "Requests waiting for a KV cache "
                                "slot", labels, registry=reg)
        self.kv_usage = pc.Gauge(p + "kv_cache_usage_perc", "Fraction of KV cache blocks in "
                                 "use (1 = full)", labels, registry=reg)
        self.prefix_queries = pc.Counter(p + "prefix_cache_queries", "Prompt tokens looked up "
                                         "in the prefix cache", labels, registry=reg)
        self.prefix_hits = pc.Counter(p + "prefix_cache_hits", "Prompt tokens found in the "
                                      "prefix cache", labels, registry=reg)
        self.hit_rate = pc.Gauge(p + "prefix_cache_hit_rate", "Prefix cache hits / queries "
                                 "(tokens) so far", labels, registry=reg)
        self.preemptions = pc.Counter(p + "num_preemptions", "Requests preempted (KV cache "
                                      "full; recomputed later)", labels, registry=reg)
        self._totals = [{} for _ in range(dp)]  # the engines' counts at the last report
        self.tokens_per_s = pc.Gauge(p + "generation_tokens_per_second", "Generated tokens "
                                     f"per second over the last {RATE_WINDOW_S:g} s", labels,
                                     registry=reg)
        self.ttft = pc.Histogram(p + "time_to_first_token_seconds", "Time to first token",
                                 labels, buckets=TTFT_BUCKETS, registry=reg)
        self.itl = pc.Histogram(p + "inter_token_latency_seconds", "Time between tokens",
                                labels, buckets=ITL_BUCKETS, registry=reg)
        self.queue = pc.Histogram(p + "request_queue_time_seconds", "Time waiting in the "
                                  "engine before prefill", labels, buckets=REQUEST_BUCKETS,
                                  registry=reg)
        self.e2e = pc.Histogram(p + "e2e_request_latency_seconds", "Arrival to last token",
                                labels, buckets=REQUEST_BUCKETS, registry=reg)
        self.request_preemptions = pc.Histogram(p + "request_preemptions", "Times a request "
                                                "was preempted (KV cache full)", labels,
                                                buckets=PREEMPTION_BUCKETS, registry=reg)
        self.model_name, self.dp = model_name, dp
        self._recent = [deque() for _ in range(dp)]  # (monotonic time, tokens) per replica
        self._lock = threading.Lock()
        for r in range(dp):
            lab = (model_name, str(r))
            for g in (self.running, self.waiting, self.kv_usage, self.hit_rate):
                g.labels(*lab).set(0)
            for c in (self.prefix_queries, self.prefix_hits, self.preemptions):
                c.labels(*lab)  # exported as 0 from the start
            self.tokens_per_s.labels(*lab).set_function(lambda r=r: self._rate(r))

    def _rate(self, replica: int) -> float:
        now = time.monotonic()
        with self._lock:
            q = self._recent[replica]
            while q and q[0][0] < now - RATE_WINDOW_S:
                q.popleft()
            return sum(n for _, n in q) / RATE_WINDOW_S

    def error(self, kind: str) -> None:
        self.errors.labels(self.model_name, kind).inc()

    def event(self, replica: int, e, arrival: float, last: float | None) -> None:
        """Account engine event `e` of a request that arrived at `arrival` (monotonic
        seconds) and whose previous event with tokens came at `last` (None: none yet)."""
        lab = (self.model_name, str(replica))
        now = time.monotonic()
        n = len(e.token_ids)
        if n and last is None:  # its first tokens
            self.prompt_tokens.labels(*lab).inc(e.prompt_tokens)
            if getattr(e, "queue_s", None) is not None:
                self.queued(replica, e.queue_s)
        if n:
            self.generation_tokens.labels(*lab).inc(n)
            with self._lock:
                self._recent[replica].append((now, n))
            if last is None:
                self.ttft.labels(*lab).observe(now - arrival)
            else:
                self.itl.labels(*lab).observe((now - last) / n)
        if e.finish_reason is not None:
            reason = "abort" if e.finish_reason == "cancelled" else e.finish_reason
            self.success.labels(*lab, reason).inc()
            self.e2e.labels(*lab).observe(now - arrival)
            if getattr(e, "preemptions", None) is not None:
                self.preempted(replica, e.preemptions)

    def queued(self, replica: int, seconds: float) -> None:
        """A request waited `seconds` in its engine's queue before its first prefill (or,
        cancelled before it, until then)."""
        self.queue.labels(self.model_name, str(replica)).observe(seconds)

    def preempted(self, replica: int, times: int) -> None:
        """A request ended after being preempted `times` times."""
        self.request_preemptions.labels(self.model_name, str(replica)).observe(times)

    def aborted(self, replica: int, arrival: float) -> None:
        """A request ended before it finished: its client went away, or it failed."""
        lab = (self.model_name, str(replica))
        self.success.labels(*lab, "abort").inc()
        self.e2e.labels(*lab).observe(time.monotonic() - arrival)

    def replica_stats(self, replica: int, stats: dict) -> None:
        """`stats` from the replica's engine (`Engine.stats`): running, waiting,
        kv_cache_usage, and the running totals prefix_cache_queries / prefix_cache_hits /
        num_preemptions (their counters grow by the difference since the last report)."""
        lab = (self.model_name, str(replica))
        self.running.labels(*lab).set(stats["running"])
        self.waiting.labels(*lab).set(stats["waiting"])
        self.kv_usage.labels(*lab).set(stats["kv_cache_usage"])
        seen = self._totals[replica]
        for key, counter in (("prefix_cache_queries", self.prefix_queries),
                             ("prefix_cache_hits", self.prefix_hits),
                             ("num_preemptions", self.preemptions)):
            now = stats.get(key, 0)
            if now > seen.get(key, 0):
                counter.labels(*lab).inc(now - seen.get(key, 0))
            seen[key] = now
        if "spec_decode" in stats:
            self._spec_stats(replica, stats["spec_decode"])
        if seen.get("prefix_cache_queries"):
            self.hit_rate.labels(*lab).set(seen["prefix_cache_hits"] /
                                           seen["prefix_cache_queries"])

    def _spec_stats(self, replica: int, spec: dict) -> None:
        """Speculative decoding's running totals (`SpecStats.as_dict`): counters grow by the
        difference since the last report; the metrics are made at the first report."""
        pc, labels, p = self._pc, ("model_name", "replica"), "shardzoo:spec_decode_"
        if not hasattr(self, "spec_counters"):
            reg = self.registry
            self.spec_counters = {
                key: pc.Counter(p + key, text, labels, registry=reg) for key, text in (
                    ("num_drafts", "Verified rows that carried drafts"),
                    ("num_draft_tokens", "Drafted tokens verified"),
                    ("num_accepted_tokens", "Drafted tokens accepted"))}
            self.spec_per_pos = pc.Counter(p + "num_accepted_tokens_per_pos", "Drafted tokens "
                                           "accepted, by position in their row",
                                           labels + ("position",), registry=reg)
            self.spec_rate = pc.Gauge(p + "draft_acceptance_rate", "Accepted / drafted tokens "
                                      "so far", labels, registry=reg)
            self.spec_length = pc.Gauge(p + "mean_acceptance_length", "Tokens emitted per "
                                        "verified row so far (1 + accepted / drafts)", labels,
                                        registry=reg)
        lab = (self.model_name, str(replica))
        seen = self._totals[replica].setdefault("spec_decode", {})
        for key, counter in self.spec_counters.items():
            if spec[key] > seen.get(key, 0):
                counter.labels(*lab).inc(spec[key] - seen.get(key, 0))
            seen[key] = spec[key]
        before = seen.get("accepted_per_pos", [])
        for pos, n in enumerate(spec["accepted_per_pos"]):
            done = before[pos] if pos < len(before) else 0
            if n > done:
                self.spec_per_pos.labels(*lab, str(pos)).inc(n - done)
        seen["accepted_per_pos"] = list(spec["accepted_per_pos"])
        if spec["num_draft_tokens"]:
            self.spec_rate.labels(*lab).set(spec["num_accepted_tokens"] /
                                            spec["num_draft_tokens"])
            self.spec_length.labels(*lab).set(1 + spec["num_accepted_tokens"] /
                                              spec["num_drafts"])

    def render(self) -> bytes:
        return self._pc.generate_latest(self.registry)
