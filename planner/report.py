"""What the trainer logs beside its own measurements: the planner's predicted memory at start,
the counted vs predicted communication of the first step (`--report-comm`), and at the end of
the run predicted vs measured communication and pipeline bubble."""
from __future__ import annotations

import copy
import dataclasses

from parallel_state.comm_counter import gather_counts

from . import moe
from .communication import step_communication
from .memory import pipeline_bubble, rank_memory


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def _ratio(measured: float, predicted: float) -> float | None:
    return measured / predicted if predicted else (1.0 if not measured else None)


def memory_prediction(config, pp_rank: int, measured: dict,
                      base_formats: dict | None = None) -> tuple[dict, str]:
    """The planner's bytes for this rank beside `measured` (trainer.log_memory's fields:
    `model_state_total_bytes`, `activation_bytes_per_microbatch`, a LoRA run's
    `frozen_base_bytes`, an FP8 run's `fp8_buffer_bytes`): (record fields, line).
    `base_formats`: `rank_memory`'s."""
    pred = rank_memory(config, pp_rank, base_formats)
    states, act = measured["model_state_total_bytes"], measured["activation_bytes_per_microbatch"]
    frozen = measured.get("frozen_base_bytes", 0)
    fp8 = measured.get("fp8_buffer_bytes", 0)
    rec = {"planner_model_state_bytes": pred["model_states"],
           "planner_frozen_base_bytes": pred["frozen_base"],
           "planner_frozen_base_ratio": _ratio(frozen, pred["frozen_base"]),
           "planner_fp8_buffer_bytes": pred["fp8_buffers"],
           "planner_fp8_buffer_ratio": _ratio(fp8, pred["fp8_buffers"]),
           "planner_transient_bytes": pred["transient"],
           "planner_gathered_params_peak_bytes": pred["gathered_params"],
           "planner_activation_bytes_per_microbatch": pred["activations_per_microbatch"],
           "planner_microbatches_in_flight": pred["in_flight"],
           "planner_peak_bytes": pred["total"],
           "planner_model_state_ratio": _ratio(states, pred["model_states"]),
           "planner_activation_ratio": _ratio(act, pred["activations_per_microbatch"])}
    line = (f"planner (tools/plan.py) for this rank: model states {_mib(pred['model_states'])} "
            f"MiB (measured {_mib(states)}, ratio {rec['planner_model_state_ratio']:.3f}), "
            + (f"frozen base {_mib(pred['frozen_base'])} MiB (measured {_mib(frozen)}, ratio "
               f"{rec['planner_frozen_base_ratio']:.3f}), " if pred["frozen_base"] else "")
            + (f"FP8 buffers {pred['fp8_buffers'] / 2**10:,.1f} KiB (measured "
               f"{fp8 / 2**10:,.1f}, ratio {rec['planner_fp8_buffer_ratio']:.3f}), "
               if pred["fp8_buffers"] else "")
            + f"activations {_mib(pred['activations_per_microbatch'])} MiB per microbatch "
            f"(measured {_mib(act)}, ratio {rec['planner_activation_ratio']:.3f}) x "
            f"{pred['in_flight']} in flight"
            + (f" (chunk-microbatches over {config.train.virtual_pipeline_model_parallel_size} "
               f"chunks)" if (config.train.virtual_pipeline_model_parallel_size or 1) > 1 else "")
            + f", predicted peak {_mib(pred['total'])} MiB")
    if moe.is_moe(config.model):  # total vs active (planner/moe.py `parameter_counts`)
        counts = moe.parameter_counts(config.model)
        ep, _, edp = moe.expert_layout(config)
        rec.update(num_parameters=counts["total"], num_active_parameters=counts["active"])
        line += (f"; {moe.describe_parameters(config.model)}; experts over ep {ep}, their "
                 f"gradients over edp {edp}")
    return rec, line


def step_config(config, global_batch_size: int):
    """`config` for a step of `global_batch_size` sequences (batch ramp-up changes it)."""
    out = copy.copy(config)
    out.train = dataclasses.replace(config.train, global_batch_size=global_batch_size)
    out.num_microbatches = global_batch_size // (config.train.micro_batch_size *
                                                 config.data_parallel_size)
    return out


def comm_report(config, counted: dict, iteration: int, first_step: bool = False,
                steps: int = 1) -> tuple[dict, list[str]]:
    """Counted (summed over ranks, parallel_state.comm_counter) vs predicted calls and bytes
    of `steps` steps ending at `iteration` (DiLoCo: one outer step), per group and op, as
    totals (whole calls): (metrics record, one line per group and op). The prediction is
    `steps` synchronous steps. `first_step`: the first counted step is the run's first (see
    `step_communication`)."""
    predicted = step_communication(config, first_step)
    if steps > 1:
        steady = step_communication(config, False)
        predicted = {k: (c + (steps - 1) * steady.get(k, (0, 0))[0],
                         b + (steps - 1) * steady.get(k, (0, 0))[1])
                     for k, (c, b) in predicted.items()}
    rows, lines = [], []
    for key in sorted(set(counted) | set(predicted)):
        (c_calls, c_bytes), (p_calls, p_bytes) = counted.get(key, (0, 0)), \
            predicted.get(key, (0, 0))
        # calls the planner does not model (e.g. --profile-pipeline's timeline gather): n/a
        ratio = None if c_calls and not p_calls else _ratio(c_bytes, p_bytes)
        rows.append({"group": key[0], "op": key[1], "calls": c_calls, "bytes": c_bytes,
                     "predicted_calls": p_calls, "predicted_bytes": p_bytes, "ratio": ratio})
        lines.append(f"{key[0]:<9} {key[1]:<21} {c_calls:>7} calls {c_bytes:>14,} B | "
                     f"planner {p_calls:>7} calls {p_bytes:>14,} B | ratio "
                     + ("n/a" if ratio is None else f"{ratio:.3f}"))
    total_c = sum(b for _, b in counted.values())
    total_p = sum(b for _, b in predicted.values())
    if not lines:
        lines.append("no collectives (a world of one process)")
    if any(key[0] == "ep" for key in set(counted) | set(predicted)):
        lines.append("ep: the token all-to-alls depend on the routing; summed over ranks the "
                     "dropless count equals the prediction, with capacity dropping the "
                     "prediction assumes a balanced load (compare the ratio, planner/moe.py)")
    rec = {"iteration": iteration, "event": "comm", "first_step": first_step, "steps": steps,
           "comm": rows,
           "comm_bytes": total_c,
           "comm_bytes_predicted": total_p, "comm_ratio": _ratio(total_c, total_p)}
    return rec, lines


def log_comm(config, counts: dict, global_batch_size: int, iteration: int, logger,
             first_step: bool, steps: int = 1) -> dict:
    """Sum this rank's `counts` (CommCounter.stop() of the `steps` steps ending at
    `iteration`) over all ranks (every rank calls this) and log them beside the planner's
    prediction, one line per group and op; returns the metrics record (`comm_report`).
    `global_batch_size`: the counted step's (batch ramp-up changes it)."""
    rec, lines = comm_report(step_config(config, global_batch_size), gather_counts(counts),
                             iteration, first_step, steps)
    which = f"step {iteration}" if steps == 1 else \
        f"steps {iteration - steps + 1}..{iteration} ({steps} steps, totals)"
    logger.log(rec, f"communication of {which} (calls and payload bytes summed over all "
                    f"{config.world_size} ranks; planner: planner/communication.py):\n  "
                    + "\n  ".join(lines), prefix="comm")
    return rec


def run_end_summary(config, comm: dict | None, bubble: dict | None) -> tuple[dict, str]:
    """The closing comparison: counted vs predicted bytes of the counted step, and the
    predicted bubble of the run's schedule (planner/memory.py `pipeline_bubble`) beside the
    measured one (--profile-pipeline's replay)."""
    theory = pipeline_bubble(config)
    rec = {"event": "planner_vs_measured", "bubble_predicted": theory}
    parts = []
    if comm is not None:
        rec.update({k: comm[k] for k in ("comm_bytes", "comm_bytes_predicted", "comm_ratio")})
        ratio = "n/a" if comm["comm_ratio"] is None else f"{comm['comm_ratio']:.3f}"
        steps = comm.get("steps", 1)
        parts.append(f"communication {comm['comm_bytes']:,} B counted vs "
                     f"{comm['comm_bytes_predicted']:,} B predicted "
                     + ("per step" if steps == 1 else f"over the {steps} counted steps")
                     + f" (ratio {ratio})")
    if bubble is not None:
        rec["bubble_measured"] = bubble["bubble_replay"]
        parts.append(f"bubble predicted {theory:.3f}, measured (replay, per stage) "
                     + " ".join(f"{x:.3f}" for x in bubble["bubble_replay"]))
    else:
        parts.append(f"bubble predicted {theory:.3f} (measure it with --profile-pipeline)")
    return rec, "planner vs measured: " + "; ".join(parts)
