"""Mixed dtypes are served: a float32, bfloat16 or float16 source, mapper and target, in every combination, through
every probe, every rung (mapped, repaired, the target's own prefill), the calibrated default handoff and a session's
switch of the shipped tiny family."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_kvmap import GuardLadder, HandoffSession, LadderRung, MapperModel, handoff, zoo
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.serving.pipeline import prepare_context, serve_rows
from hf_kvmap.serving.probes import probe_from_dict

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROBES = [
    {"name": "tail_nll", "tokens": 4},
    {"name": "draft_agreement", "tokens": 2},
    {"name": "confident_draft", "tokens": 2},
    {"name": "lookahead_margin", "tokens": 2},
    {"name": "prefix_audit", "tokens": 8},
    {"name": "linear", "components": [{"name": "confident_draft", "tokens": 2}], "weights": [1.0]},
]


@pytest.fixture(scope="module")
def prompts(one_thread):
    tokenizer = zoo.load_tokenizer()
    items = [item for task in zoo.tiny_family_tasks(3, seed=5) if task.name == "recall" for item in task.items]
    rows = [tokenizer(item.context)["input_ids"][:40] for item in items]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    return ids, mask


@pytest.mark.parametrize("source_dtype,mapper_dtype,target_dtype", list(itertools.product(DTYPES, repeat=3)))
def test_every_probe_and_rung_serves_any_dtype_mix(prompts, source_dtype, mapper_dtype, target_dtype):
    ids, mask = prompts
    source = zoo.load_model("tiny-m", dtype=DTYPES[source_dtype])
    target = zoo.load_model("tiny-l", dtype=DTYPES[target_dtype])
    mapper = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l"), dtype=DTYPES[mapper_dtype])
    for settings in PROBES:
        probe = probe_from_dict(settings)
        context = prepare_context(source, target, mapper, ids, mask, None, probe.hold_back)
        risks = probe.score(context)
        assert risks.shape == (3,) and bool(torch.isfinite(risks).all()), settings
        rows = serve_rows(context, [0.0, 0.3, None], {"name": "source_attention", "last_tokens": 4})
        assert [row["rung"] for row in rows] == ["mapped", "repair:0.3", "fallback"]
        assert context.cache.layers[0].keys.dtype == DTYPES[target_dtype]
        out = target.generate(
            ids, attention_mask=mask, **cache_kwargs(context.cache), max_new_tokens=2, do_sample=False, pad_token_id=0
        )
        assert out.shape == (3, ids.shape[1] + 2)
    # the default call: the mapper's calibrated probe (confident_draft), and its refusal's fallback
    for threshold in (None, -1.0):
        extra = {} if threshold is None else {"probe": "confident_draft", "threshold": threshold}
        cache, report = handoff(source, target, mapper, ids[:1], **extra)
        assert report.reason and cache.get_seq_length() == ids.shape[1] - 1
        if threshold is not None:
            assert not report.accepted and type(cache).__name__ == "DynamicCache"
    # a session's switch on each rung
    row = ids[0][mask[0].bool()].tolist()
    lookahead = {"name": "lookahead_margin", "tokens": 2}
    for rungs, rung in (([LadderRung(2.0, 0.0)], "mapped"), ([LadderRung(2.0, 0.3)], "repair:0.3"), ([], "fallback")):
        session = HandoffSession(
            {"m": source, "l": target}, {("m", "l"): mapper}, row[:-5], ladder=GuardLadder(lookahead, "tail", rungs)
        )
        session.respond("m", 2, pad_token_id=0)
        session.append(row[-5:])
        assert session.respond("l", 2, pad_token_id=0).rung == rung
