"""rheoplan: lossless stochastic dynamic-tree speculative decoding (RheoSampling).

Start with ``plan_and_decode`` (the decode loop), ``plan_tree`` (one draft tree),
``TreeConfig`` / ``SamplingConfig`` and ``rheoplan.testing`` (the exact oracle).
"""

from rheoplan.config import ConfigError, SamplingConfig, TreeConfig
from rheoplan.ir import DraftTree, LinearTree, NodeKind
from rheoplan.plan import plan_tree

__all__ = ["ConfigError", "SamplingConfig", "TreeConfig", "DraftTree", "LinearTree", "NodeKind", "plan_tree"]
__version__ = "0.1.0"
