"""rheoplan: lossless stochastic dynamic-tree speculative decoding (RheoSampling).

Start with ``plan_and_decode`` (the decode loop, returns a ``DecodeResult`` with one
``StepStats`` per step; a list of prompts decodes them as one batch),
``decode_requests`` (a stream of requests, batched as they come), ``plan_tree`` (one draft tree), ``TreeConfig`` /
``SamplingConfig``, ``rheoplan.models`` (adapters: ``as_target``, ``as_draft``,
``load_eagle3``) and ``rheoplan.testing`` (the exact oracle). docs/method.md explains the
method.

Example:
    >>> from rheoplan import plan_and_decode, TreeConfig
    >>> from rheoplan.models import hashed_context_lm
    >>> lm = hashed_context_lm(vocab_size=6, seed=1)
    >>> cfg = TreeConfig(depth=2, frontier=2, slots=2, budget=4, support=6)
    >>> len(plan_and_decode(lm, lm, [0, 1], max_new_tokens=4, tree=cfg, seed=0).tokens)
    4
"""

from rheoplan.config import ConfigError, SamplingConfig, TreeConfig
from rheoplan.decode import DecodeResult, StepStats, plan_and_decode
from rheoplan.ir import DraftTree, LinearTree, NodeKind
from rheoplan.plan import plan_tree
from rheoplan.stream import Request, decode_requests

__all__ = ["plan_and_decode", "decode_requests", "Request", "plan_tree", "SamplingConfig", "TreeConfig", "DecodeResult", "StepStats",
           "ConfigError", "DraftTree", "LinearTree", "NodeKind"]
__version__ = "0.1.0"
