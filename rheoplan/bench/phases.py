"""Where a decode step's time goes, from one benchmark record: the arithmetic that
``rheoplan bench cost`` and ``rheoplan bench decode`` share.

A record (``rheoplan.bench.decode.run_group``) holds a run's wall ``seconds``, its
``steps`` and ``phase_seconds``: the time inside each phase of ``plan_and_decode``
(``PHASES``), the steps' whole wall time (``step``) and, of the walk, the output
projection (``project``). ``breakdown`` turns them into ms per step, the lean-step
quantities (bookkeeping per step, a drafted depth against its draft call) and the
accepted length at which the run would break even with an autoregressive decoder.
"""

from __future__ import annotations

#: plan_and_decode's phases, in the order a step runs them
PHASES = ("draft", "plan", "verify_forward", "walk", "commit")


def breakdown(record: dict, ar_ms_per_token: float) -> dict:
    """Per-step cost of one run record and the tau it would need.

    ``other`` is wall time not inside a phase (prefill, loop bookkeeping), so the phases
    and ``other`` add up to the measured wall time per step. ``break_even_tau`` is the
    accepted length at which the method would match an autoregressive decoder costing
    ``ar_ms_per_token``; ``tau_for_1_3x`` the one for a 1.3x speed-up.

    Example: 10 steps in 1.5 s, 0.9 s of them in the verify forward, against a decoder of
    50 ms per token:
        >>> b = breakdown({"method": "m", "steps": 10, "seconds": 1.5, "mean_accepted_length": 2.0,
        ...                "tokens_per_second": 13.3, "phase_seconds": {"verify_forward": 0.9}}, 50.0)
        >>> b["step_ms"], b["phase_ms"]["verify_forward"], b["break_even_tau"]
        (150.0, 90.0, 3.0)
    """
    steps = record["steps"]
    if steps < 1 or ar_ms_per_token <= 0:
        raise ValueError(f"need steps >= 1 and ar_ms_per_token > 0, got {steps} and {ar_ms_per_token}")
    step_ms = 1e3 * record["seconds"] / steps
    ps = record.get("phase_seconds", {})
    phase_ms = {k: 1e3 * ps.get(k, 0.0) / steps for k in PHASES}
    phase_ms["other"] = step_ms - sum(phase_ms.values())
    tau = record["mean_accepted_length"]
    out = {"method": record["method"], "tau": tau, "step_ms": step_ms, "phase_ms": phase_ms,
           "ms_per_token": step_ms / tau, "tokens_per_second": record["tokens_per_second"],
           "break_even_tau": step_ms / ar_ms_per_token, "tau_for_1_3x": 1.3 * step_ms / ar_ms_per_token}
    if "step" in ps:
        # split ``other`` into the loop's own bookkeeping (inside the steps) and the prefill
        loop_other = 1e3 * ps["step"] / steps - sum(phase_ms[k] for k in PHASES)
        out["loop_other_ms"] = loop_other
        out["prefill_ms_per_step"] = phase_ms["other"] - loop_other
        out["bookkeeping_ms"] = phase_ms["plan"] + phase_ms["walk"] + phase_ms["commit"] + loop_other
        # of it, the walk's output projection (StepStats.t_project): model compute, which
        # generate counts inside its forward
        out["projection_ms"] = 1e3 * ps.get("project", 0.0) / steps
    if phase_ms["draft"] > 0:
        # a drafted depth = its draft call + its share of the planner passes, against the
        # call alone (conservative: prune and linearize are counted in the planner's share)
        out["depth_vs_head_forward"] = (phase_ms["draft"] + phase_ms["plan"]) / phase_ms["draft"]
    return out
