"""The shipped SmolLM2 head loads strictly through the project's loader (no SmolLM2 needed), and
the list of the shards it was trained on agrees with its report."""

from __future__ import annotations

import json
import os

import torch

from rheoplan.models.eagle3 import read_eagle3
from rheoplan.train import cli
from rheoplan.train import tokens as tk

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "..", "rheoplan", "assets", "smollm2-eagle3")


def test_shipped_head_loads_and_is_small():
    head = read_eagle3(ASSET)
    cfg = head.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.target_hidden_size, cfg.draft_vocab_size) == (49152, 576, 576, 8192)
    ids = head.target_ids()
    assert len(set(ids.tolist())) == 8192 and torch.equal(head.t2d.nonzero().flatten(), ids.sort().values)
    assert bool(head.t2d[2])  # <|im_end|> (EOS of the chat template) is draftable
    assert os.path.getsize(os.path.join(ASSET, "model.safetensors")) <= 30 * 2**20
    for name in ("config.json", "MODEL_CARD.md"):
        assert os.path.exists(os.path.join(ASSET, name))


def test_shipped_heads_shard_list_matches_its_report():
    # train_shards.txt (for --shards / --exclude-shards) names the shards report.json counted
    names = cli.read_shard_names(os.path.join(ASSET, "train_shards.txt"), "--shards")
    with open(os.path.join(ASSET, "report.json")) as f:
        data = json.load(f)["data"]
    gen = data["generation"]
    assert len(names) == len(set(names)) == data["train"]["shards"]
    # every training split the data set had when the head was trained (train_fu, train_r1 and,
    # once --more-prompts grew it, train_x_fu, train_x_r1), each counted whole
    splits = [s for s in gen if s != "heldout"]
    assert {"train_fu", "train_r1"} <= set(splits)
    assert sum(gen[s]["shards"] for s in splits) == len(names)
    for split in splits:
        assert sum(n.startswith(split + "_") for n in names) == gen[split]["shards"]
    tokens = os.path.join(ASSET, "..", "..", "data", "selfdistill_tokens")
    rows = sum(tk.read_shard(tokens, n)[0]["rows"] for n in names)
    assert rows == sum(gen[s]["rows"] for s in splits)
