"""as_target / as_draft dispatch."""

from __future__ import annotations

import pytest

from rheoplan.models import as_draft, as_target
from rheoplan.models.functional import FunctionalDraft, FunctionalTarget, hashed_context_lm
from rheoplan.models.hf_draft import HFDraft
from rheoplan.models.hf_target import HFTarget


def test_dispatch(llama):
    lm = hashed_context_lm(5)
    assert isinstance(as_target(lm), FunctionalTarget)
    assert isinstance(as_draft(lm), FunctionalDraft)
    assert isinstance(as_target(llama), HFTarget)
    assert isinstance(as_draft(llama), HFDraft)
    t = FunctionalTarget(lm)
    assert as_target(t) is t
    with pytest.raises(TypeError, match="cannot use int as a target"):
        as_target(3)
    with pytest.raises(TypeError, match="as a draft"):
        as_draft("x")
