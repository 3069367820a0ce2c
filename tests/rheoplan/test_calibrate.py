"""A head's acceptance priors (``rheoplan.calibrate``): decoded from training prompts, one
per temperature, capped, reproducible; ``load_cost_model`` finds them next to the head."""

from __future__ import annotations

import pytest

import rheoplan.loading as loading
from rheoplan import TreeConfig
from rheoplan.calibrate import TRAIN_PROMPTS, calibrate_head, training_prompts, with_width_counts
from rheoplan.costmodel import PRIORS_FILE, Calibration, CostModel, Timings, load_priors, save_priors
from rheoplan.models.functional import hashed_context_lm

TIMINGS = Timings((1, 64), (10.0, 73.0), (12.0, 75.0), 0, 1000, (1, 4), (0.5, 1.0), 0.5, 0.5)
TREE = TreeConfig(depth=3, frontier=2, slots=2, budget=6, rheostat=1, support=5)


def _models():
    return hashed_context_lm(5, seed=1, sharpness=2.0), hashed_context_lm(5, seed=2, sharpness=2.0)


def test_priors_per_temperature_are_capped_and_reproducible():
    tgt, drf = _models()
    prompts = [[0, 1, 2], [3, 4], [2, 2, 1, 0]]
    kw = dict(timings=TIMINGS, tree=TREE, temperatures=[1.0, 0.0], tokens=12, max_trials=5, progress=False)
    a = calibrate_head(tgt, drf, prompts, **kw)
    assert sorted(a) == [0.0, 1.0]
    for cal in a.values():
        trials = [t for row in cal.trials for t in row] + cal.cont_trials
        assert max(trials) == pytest.approx(5.0) and all(t <= 5.0 + 1e-9 for t in trials)
    assert a[0.0] != a[1.0]  # greedy and sampled acceptances differ
    assert calibrate_head(tgt, drf, prompts, **kw) == a


def test_width_counts_added_to_older_priors_leave_the_rest_as_it_was():
    """``--add-width-counts``: the decodes start from the head's priors (``start``), and the
    upgraded prior is the old one with the run's width counts, nothing else."""
    tgt, drf = _models()
    prompts = [[0, 1, 2], [3, 4], [2, 2, 1, 0]]
    kw = dict(timings=TIMINGS, tree=TREE, temperatures=[1.0], tokens=12, max_trials=5, progress=False)
    old = calibrate_head(tgt, drf, prompts, **kw)[1.0]
    old.width_trials = Calibration().width_trials  # a file from before the width counts
    old.width_accepts = Calibration().width_accepts
    start = CostModel(TIMINGS, priors=((1.0, old),))
    run = calibrate_head(tgt, drf, prompts, start=start, **kw)[1.0]
    assert run != calibrate_head(tgt, drf, prompts, **kw)[1.0]  # started from the prior, not from nothing
    up = with_width_counts(old, run)
    assert sum(map(sum, up.width_trials)) > 0 and up.width_trials == run.width_trials
    assert up.width_accepts == run.width_accepts
    assert (up.trials, up.accepts, up.cont_trials, up.cont_accepts, up.predicted, up.realized) == (
        old.trials, old.accepts, old.cont_trials, old.cont_accepts, old.predicted, old.realized)


@pytest.mark.parametrize("bad,match", [
    (dict(prompts=[]), "prompts is empty"), (dict(temperatures=[]), "temperatures"),
    (dict(temperatures=[-1.0]), "temperatures"), (dict(tokens=0), "tokens=0"),
])
def test_calibrate_rejects_bad_input(bad, match):
    tgt, drf = _models()
    kw = dict(prompts=[[0, 1]], timings=TIMINGS, tree=TREE, temperatures=[1.0], tokens=4, progress=False)
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        calibrate_head(tgt, drf, kw.pop("prompts"), **kw)


def test_training_prompts_spread_over_the_file(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("".join(f"cat\tprompt {i}\n" for i in range(10)))
    assert training_prompts(5, f) == ["prompt 0", "prompt 2", "prompt 4", "prompt 6", "prompt 8"]
    for n, match in ((0, "prompts=0"), (11, "holds 10 prompts")):
        with pytest.raises(ValueError, match=match):
            training_prompts(n, f)
    held = {line.split("\t", 1)[-1].strip() for line in (TRAIN_PROMPTS.parent / "prompts_heldout.txt")
            .read_text().splitlines()}
    assert not set(training_prompts(16)) & held  # the shipped defaults never calibrate on held-out prompts


def test_load_cost_model_finds_a_heads_priors(tmp_path, monkeypatch):
    head = tmp_path / "head"
    head.mkdir()
    assert loading.head_priors_path(f"eagle3:{head}") is None  # no file: no priors
    save_priors(head / PRIORS_FILE, {1.0: Calibration()})
    assert loading.head_priors_path(f"eagle3:{head}") == head / PRIORS_FILE
    assert loading.head_priors_path("early-exit:6") is None and loading.head_priors_path("nonsense") is None
    monkeypatch.setattr(loading, "measure_timings", lambda *a, **k: TIMINGS)
    monkeypatch.setattr(loading, "encode_prompt", lambda *a, **k: [0])
    cm = loading.load_cost_model(None, None, None, TREE, draft_id=f"eagle3:{head}")
    assert cm.priors == tuple(load_priors(head / PRIORS_FILE).items()) and cm.calibration is None
    assert loading.load_cost_model(None, None, None, TREE, draft_id=f"eagle3:{head}", calibration="none").priors == ()


def test_load_cost_model_measures_the_bookkeeping_with_a_sampled_law(monkeypatch):
    """One cached record serves every decode: a greedy caller's latencies are measured with
    a sampled law (T = 1; a greedy walk's bookkeeping is the cheaper), a sampling caller's
    with its own settings."""
    from rheoplan.config import SamplingConfig

    seen = []
    monkeypatch.setattr(loading, "measure_timings", lambda *a, **k: seen.append(k["sampling"]) or TIMINGS)
    monkeypatch.setattr(loading, "encode_prompt", lambda *a, **k: [0])
    hot = SamplingConfig(temperature=0.7, top_p=0.9)
    for s in (None, SamplingConfig(temperature=0.0), hot):
        loading.load_cost_model(None, None, None, TREE, calibration="none", sampling=s)
    assert seen == [SamplingConfig(), SamplingConfig(), hot]
