"""A draft head's acceptance priors: what the cost model should believe before a decode has
verified anything (``rheoplan calibrate``).

The cost model estimates each drafted node's acceptance from online counts per weight
bucket (``rheoplan.costmodel.Calibration``). A decode that starts from nothing uses the
bucket midpoint as its prior, i.e. it trusts the draft's own probability; a head that is
overconfident then makes the first steps' trees too large, and with a 64-token answer the
first steps are a good part of the decode. Measured with the shipped SmolLM2 head (12
held-out prompts x 64 tokens, T = 1, docs/results.md): the trees' predicted accepted
length was 2.02 against 1.86 realised without a prior; 1.94 against 1.95 with one, and
the decode ran 2-8% faster.

``calibrate_head`` decodes training prompts (never the held-out ones) with the cost model,
chaining each decode's calibration into the next, once per temperature, and caps each
bucket at ``max_trials`` trials (``Calibration.capped``) so a decode's own counts take over
after a few dozen trials. The file goes next to the head's weights
(``costmodel.PRIORS_FILE``), where ``rheoplan.loading.load_cost_model`` finds it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from rheoplan.config import SamplingConfig, TreeConfig
from rheoplan.costmodel import Calibration, CostModel, Timings
from rheoplan.decode import plan_and_decode

#: trials per bucket a prior keeps (``Calibration.capped``); 40 beat an uncapped prior
#: (1.33x vs 1.30x ``generate``, 12 held-out prompts, T = 1) in the first A/B above
MAX_TRIALS = 40.0
TRAIN_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts_train.txt"


def training_prompts(n: int, path: str | Path = TRAIN_PROMPTS) -> list[str]:
    """``n`` prompts spread evenly over a ``category<TAB>prompt`` file (the training set)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"prompts={n!r} is out of range: allowed an int >= 1")
    rows = [line.split("\t", 1)[1].strip() for line in Path(path).read_text().splitlines() if "\t" in line]
    if n > len(rows):
        raise ValueError(f"prompts={n} is out of range: {path} holds {len(rows)} prompts")
    step = len(rows) / n
    return [rows[int(i * step)] for i in range(n)]


def calibrate_head(model, draft, prompts: Sequence[Sequence[int]], *, timings: Timings, tree: TreeConfig,
                   temperatures: Sequence[float], tokens: int = 64, max_trials: float = MAX_TRIALS,
                   seed: int = 0, backend: str = "auto", progress: bool = True,
                   start: CostModel | None = None) -> dict[float, Calibration]:
    """``{temperature: prior}``: per temperature, the calibration of decoding every prompt
    in turn (``tokens`` new tokens each, the cost model with ``timings``, each decode
    starting from the previous one's calibration; the first from ``start``'s prior for the
    temperature, ``CostModel.fresh_calibration``, or from nothing), capped at ``max_trials``.
    Prompt ``i`` decodes with seed ``seed + i``."""
    if not prompts:
        raise ValueError("prompts is empty: allowed at least one token-id sequence")
    if not temperatures or any(not (isinstance(t, (int, float)) and t >= 0) for t in temperatures):
        raise ValueError(f"temperatures={list(temperatures)!r}: allowed numbers >= 0")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens={tokens!r} is out of range: allowed an int >= 1")
    out: dict[float, Calibration] = {}
    bar = tqdm(total=len(prompts) * len(temperatures), unit="prompt", desc="calibrate", disable=not progress,
               file=sys.stderr)
    for temp in temperatures:
        cal = None if start is None else start.fresh_calibration(float(temp))
        for i, ids in enumerate(prompts):
            res = plan_and_decode(model, draft, list(ids), max_new_tokens=tokens,
                                  sampling=SamplingConfig(temperature=float(temp)), tree=tree,
                                  cost_model=CostModel(timings, cal), seed=seed + i, backend=backend)
            cal = res.calibration
            bar.update(1)
        out[float(temp)] = cal.capped(max_trials)
    bar.close()
    return out


def with_width_counts(prior: Calibration, measured: Calibration) -> Calibration:
    """A copy of ``prior`` with the continuation counts per width of ``measured`` (e.g. a
    prior file written before rheoplan kept them, upgraded by ``rheoplan calibrate
    --add-width-counts``); every other count stays the prior's, so what a one-row decode
    believes does not move."""
    out = Calibration.from_dict(prior.to_dict())
    out.width_trials = [list(r) for r in measured.width_trials]
    out.width_accepts = [list(r) for r in measured.width_accepts]
    return out
