"""The real-family pipeline on tiny stand-ins (no real weights): corpus manifest, tasks, the k = all solve, the
self-map statistics, resumable checkpoints and the retention assembly of `benchmarks.real`."""

from __future__ import annotations

import json
import math
import re
import types
from pathlib import Path

import pytest
import torch

from hf_kvmap import CalibrationStatistics, LayerSelection, MappedCache, mapper_from_statistics
from hf_kvmap._compat import cache_kwargs
from hf_kvmap.real import corpus
from lab.real.tasks import TASK_META, real_family_tasks

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def script():
    """The real-family modules of `benchmarks.real`, one namespace (what `benchmarks/real_family.py` held)."""
    from benchmarks.real import calibrate, common, family_report
    from benchmarks.real import fit as real_fit

    return _namespace(common, calibrate, real_fit, family_report)


def _namespace(*modules) -> types.SimpleNamespace:
    """The public and private names of `modules`, later ones first (for reading; patch the modules themselves)."""
    names = {}
    for module in reversed(modules):
        names.update({name: value for name, value in vars(module).items() if not name.startswith("__")})
    return types.SimpleNamespace(**names)


@pytest.fixture(autouse=True)
def _split_by_relative_path(split_by_relative_path):
    """Every test here splits the fake machine's files by their relative path (`split_by_relative_path`)."""


def test_manifest_pins_the_files_and_refuses_changes(tmp_path, tiny):
    stdlib, share = tiny.fake_machine(tmp_path)
    documents = corpus.discover(stdlib, share)
    assert {d.kind for d in documents} == {"code", "prose"}
    assert not any("test_skipped" in d.path for d in documents)
    assert {d.split for d in documents} == {"calibration", "heldout"}
    manifest = corpus.build_manifest(tmp_path / "m.json", documents)
    assert corpus.load_manifest(tmp_path / "m.json") == documents
    assert manifest["sha256"] == corpus.manifest_sha256(documents)
    Path(documents[0].path).write_text("changed")
    with pytest.raises(ValueError, match=r"0 pinned files are missing and 1 changed"):
        corpus.load_manifest(tmp_path / "m.json")
    data = json.loads((tmp_path / "m.json").read_text())
    data["files"][1][2] = "heldout" if data["files"][1][2] == "calibration" else "calibration"
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="edited by hand"):
        corpus.load_manifest(tmp_path / "m.json", verify=False)


def test_calibration_sequences_are_fixed_and_extend(tmp_path, byte_tokenizer, tiny):
    tokenizer = byte_tokenizer
    documents = corpus.discover(*tiny.fake_machine(tmp_path))
    short = corpus.calibration_sequences(tokenizer, documents, 3, length=64)
    longer = corpus.calibration_sequences(tokenizer, documents, 6, length=64)
    assert longer[:3] == short and all(len(seq) == 64 for seq in longer)
    chat = tokenizer.decode(longer[2])
    assert "Continue this text" in chat  # the third stream is chat-formatted prose
    assert corpus.sequences_sha256(short) == corpus.sequences_sha256(longer[:3])
    with pytest.raises(ValueError, match="ran out"):
        corpus.calibration_sequences(tokenizer, documents, 10_000, length=64)


def test_conversation_sequences_are_long_chats_of_the_calibration_split(tmp_path, byte_tokenizer, tiny):
    tokenizer = byte_tokenizer
    documents = corpus.discover(*tiny.fake_machine(tmp_path, files=30))
    short = corpus.conversation_sequences(tokenizer, documents, 2, length=96, turn_tokens=12)
    longer = corpus.conversation_sequences(tokenizer, documents, 4, length=96, turn_tokens=12)
    assert longer[:2] == short and all(len(seq) == 96 for seq in longer)
    assert longer[0] != longer[1]  # each conversation goes on with the next passages
    text = tokenizer.decode(longer[0])
    assert text.startswith("<user>") and text.count("<assistant>") >= 2  # many turns, both roles, in the template
    split = "\n".join([*corpus.code_texts(documents, "calibration"), *corpus.prose_texts(documents, "calibration")])
    turns = re.findall(r"<(?:user|assistant)>(.*?)<eos>", text, flags=re.S)
    assert len(turns) >= 4 and all(turn.strip() and turn in split for turn in turns)  # passages of that split only
    with pytest.raises(ValueError, match="ran out after"):
        corpus.conversation_sequences(tokenizer, documents, 10_000, length=96, turn_tokens=12)


def test_tasks_from_the_held_out_split(tmp_path, byte_tokenizer, tiny):
    tokenizer = byte_tokenizer
    documents = corpus.discover(*tiny.fake_machine(tmp_path, files=30))
    held_out = {d.path for d in documents if d.split == "heldout"}
    tasks = {t.name: t for t in real_family_tasks(tokenizer, documents, items=3)}
    assert set(tasks) == set(TASK_META)
    for name, task in tasks.items():
        assert task.task_type == TASK_META[name]["task_type"] and task.items, name
    retrieval = tasks["prose_retrieval"].items[0]
    assert f"is {retrieval.answer}." in retrieval.prompt and retrieval.answer.isdigit()
    recall = tasks["code_recall"].items[0]
    assert recall.choices[recall.label].removesuffix("(") in recall.context
    assert sum(choice.removesuffix("(") in recall.context for choice in recall.choices) == 1
    assert held_out  # every task reads held-out files only (calibration files never feed them)
    calibration_text = "".join(Path(d.path).read_text() for d in documents if d.split == "calibration")
    assert tasks["code_nll"].items[0].text not in calibration_text


def _tiny_pair_stats(tiny):
    source = tiny.model(tiny.arch_config("qwen2-biased-k"), seed=0)
    target = tiny.model(tiny.arch_config("qwen2-biased-k"), seed=1)
    ids = [torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    return source, target, CalibrationStatistics.collect(source, target, ids, progress=False)


def test_ridge_all_equals_the_library_solve(script, tiny):
    _, _, stats = _tiny_pair_stats(tiny)
    selection = LayerSelection.from_statistics(stats)
    fast = script.ridge_all_mapper(stats, selection, 0.01)
    reference = mapper_from_statistics(stats, selection=selection.with_top_k(None), ridge_lambda=0.01)
    assert fast.config.source_layers == reference.config.source_layers
    for (name, a), (_, b) in zip(fast.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_self_map_statistics_recover_the_identity(script, tiny):
    source, _, stats = _tiny_pair_stats(tiny)
    self_stats = script.self_statistics(stats, "source")
    direct = CalibrationStatistics.collect(
        source,
        source,
        [torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(i)) for i in range(3)],
        progress=False,
    )
    for kind in ("key", "value"):
        torch.testing.assert_close(self_stats[kind].cross, direct[kind].cross)
        torch.testing.assert_close(self_stats[kind].target_sumsq, direct[kind].target_sumsq)
    mapper = script.ridge_all_mapper(self_stats, LayerSelection.from_statistics(self_stats), 1e-6)
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cache = source(ids, use_cache=True).past_key_values
        mapped = MappedCache.from_source(cache, mapper)
        for layer, original in zip(mapped.layers, cache.layers):
            torch.testing.assert_close(layer.values, original.values[:, :, :19], rtol=1e-3, atol=1e-3)
        plain = source.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(
            source.generate(ids, **cache_kwargs(mapped), max_new_tokens=6, do_sample=False, pad_token_id=0), plain
        )
    with pytest.raises(ValueError, match="source side"):
        script.self_statistics(stats, "target")


def test_assemble_computes_retention_only_against_the_pair(script):
    scores = {}
    values = {"alone|0.5b": 0.5, "alone|1.5b": 1.0, "0.5b-to-1.5b|ridge-k8": 0.25, "1.5b-to-0.5b|ridge-k8": 0.5}
    for name in TASK_META:
        for way, value in values.items():
            scores[f"{name}|{way}"] = {
                "score": value + (2.0 if TASK_META[name]["task_type"] == "perplexity" else 0),
                "n_items": 4,
            }
    up = script.assemble(scores, script.SMALL, script.LARGE, "ridge-k8")
    assert up["tasks"]["prose_retrieval"]["retention"] == pytest.approx(0.25)
    assert up["tasks"]["code_recall"]["floor_normalized_retention"] == pytest.approx(0.0)  # 0.25 is chance
    assert up["perplexity"]["code_nll"] == {"source": 2.5, "target": 3.0, "mapped": 2.25, "n_items": 4}
    down = script.assemble(scores, script.LARGE, script.SMALL, "ridge-k8")
    # the small target's 2 of 4 chat answers do not beat chance (the same binomial test as every other report)
    assert down["tasks"]["chat_recall"]["retention_measurable"] is False
    assert math.isnan(down["tasks"]["chat_recall"]["retention"])
    assert up["tasks"]["prose_retrieval"]["retention_measurable"] is True
    assert script.assemble(scores, script.SMALL, script.LARGE, "ridge-all") is None


@pytest.fixture(scope="module")
def scale_script(script):
    """The scale-study modules of `benchmarks.real`, one namespace (what `benchmarks/real_scale.py` held), with the real-family
    one as `rf` and the modules as `modules` (to patch)."""
    from benchmarks.real import finetune, guard, layers, scale, scale_cli, scale_report

    namespace = _namespace(scale_report, guard, layers, finetune, scale, scale_cli)
    namespace.rf, namespace.modules = script, types.SimpleNamespace(scale=scale, scale_report=scale_report)
    return namespace


def test_scale_curve_rows_are_the_three_way_assembly_of_each_fit(scale_script):
    scores = {
        "prose_retrieval|alone|0.5b": {"score": 1.0, "n_items": 16},
        "prose_retrieval|alone|1.5b": {"score": 1.0, "n_items": 16},
        "code_recall|alone|0.5b": {"score": 0.875, "n_items": 16},
        "code_recall|alone|1.5b": {"score": 0.875, "n_items": 16},
        "prose_retrieval|2048|0.5b-to-1.5b|ridge-k8": {"score": 0.0, "n_items": 16},
        "code_recall|2048|0.5b-to-1.5b|ridge-k8": {"score": 0.25, "n_items": 16},
        "prose_retrieval|8192|0.5b-to-1.5b|ridge-k8": {"score": 0.5, "n_items": 16},
        "code_recall|8192|0.5b-to-1.5b|ridge-k8": {"score": 0.875, "n_items": 16, "fit_seconds": 3.0},
        "code_recall|8192|0.5b-to-1.5b|ridge-k8-attn": {"score": 0.875, "n_items": 16, "fit_seconds": 99.0},
        "r2|8192|0.5b-to-1.5b|ridge-k8": {"key_r2": [0.5, 0.7], "value_r2": [0.1, 0.3]},
        "calibration|8192": {"seconds": 960.0, "chunks": 4},
    }
    rows = scale_script.assemble_curve(scores)["0.5b-to-1.5b/ridge-k8"]
    assert [row["positions"] for row in rows] == [2048, 8192]  # sorted by calibration size, r2 rows not a fit
    assert rows[0]["tasks"]["code_recall"]["floor_normalized_retention"] == pytest.approx(0.0)  # chance is 0.25
    assert rows[1]["tasks"]["prose_retrieval"]["retention"] == pytest.approx(0.5)
    assert rows[1]["tasks"]["code_recall"]["floor_normalized_retention"] == pytest.approx(1.0)
    assert rows[1]["held_out_r2"] == pytest.approx({"key": 0.6, "value": 0.2})
    assert "held_out_r2" not in rows[0]
    # what the fit and the calibration pass cost, from this variant's own record (not the -attn one's)
    assert (rows[1]["fit_seconds"], rows[1]["calibration_seconds"]) == (3.0, 960.0)
    assert "fit_seconds" not in rows[0] and "calibration_seconds" not in rows[0]


def test_scale_plot_splits_the_curves_from_the_single_fits(scale_script, tmp_path):
    row = {"tasks": {"prose_retrieval": {"mapped": 0.0}}, "perplexity": {"code_nll": {"mapped": 4.0}}}
    curves = {
        "0.5b-to-1.5b/ridge-k8": [{**row, "positions": p} for p in (2048, 4096, 8192)],
        "0.5b-to-1.5b/ridge-k8-attn": [{**row, "positions": p} for p in (4096, 8192)],
        "1.5b-to-0.5b/ridge-k8": [{**row, "positions": 16384}],
    }
    scale, points = scale_script.split_curves(curves, "0.5b-to-1.5b")
    assert list(scale) == ["0.5b-to-1.5b/ridge-k8"]  # three sizes or more make a curve
    # the curve's largest fit, then every fit of the other variants; other directions stay out
    assert [label for label, _ in points] == ["ridge-k8 @8K", "ridge-k8-attn @4K", "ridge-k8-attn @8K"]
    scale_script.plot_curve(curves, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_scale_cards_are_written_for_the_plain_ridges_at_the_paper_scale_only(scale_script, tmp_path, monkeypatch):
    import shutil

    from hf_kvmap import zoo

    monkeypatch.setattr(scale_script.modules.scale_report, "CARDS", tmp_path / "cards")
    monkeypatch.setattr(scale_script.modules.scale_report, "CONFIGS", tmp_path / "configs")
    folder = scale_script.mapper_folder(tmp_path, 131072, "0.5b-to-1.5b", "ridge-k8")
    folder.mkdir(parents=True)
    shutil.copy(zoo.mapper_path("tiny-m", "tiny-l") / "config.json", folder)  # any fitted mapper's config
    task = {"source": 1.0, "target": 1.0, "mapped": 0.5, "n_items": 16, "chance": 0.0, "task_type": "exact_match"}
    row = {"tasks": {"prose_retrieval": task}, "perplexity": {}, "held_out_r2": {"key": 0.75, "value": 0.5}}
    report = {
        "run": {"items_per_task": 16, "seed": 1234},
        "environment": {"torch": torch.__version__},
        "curves": {
            "0.5b-to-1.5b/ridge-k8": [{**row, "positions": 65536}, {**row, "positions": 131072}],
            "0.5b-to-1.5b/ridge-all": [{**row, "positions": 65536}],  # below the paper's scale: no card
            "0.5b-to-1.5b/ridge-k8-attn": [{**row, "positions": 131072}],  # not a plain ridge: no card
        },
    }
    assert scale_script.write_cards(tmp_path, report) == ["qwen2.5-coder-0.5b-to-1.5b-ridge-k8-128k"]
    card = (tmp_path / "cards" / "qwen2.5-coder-0.5b-to-1.5b-ridge-k8-128k.md").read_text()
    assert "prose_retrieval" in card and "held-out key R^2 (mean over target layers): 0.75" in card
    assert (tmp_path / "configs" / "qwen2.5-coder-0.5b-to-1.5b-ridge-k8-128k" / "config.json").is_file()


def test_guard_rows_of_an_identity_handoff_keep_every_answer(one_thread):
    """The guard's rows (`benchmarks/handoff/handoff.py`'s `item_rows`, prompts and gold as the real tasks give them) on a
    model handing off to itself through the identity mapper: no answer changes at any hold-back, the mapped answer
    is right exactly when the target's own is, every candidate has a risk, and the exact audit sees no error."""
    from benchmarks.handoff import handoff as bench
    from hf_kvmap import MapperModel, zoo
    from lab.real.tasks import PromptItem

    model, tokenizer = zoo.load_model("tiny-s"), zoo.load_tokenizer()
    mapper = MapperModel.identity(model.config).eval()
    items = [PromptItem(prompt="the code of locker 7 is 4 1 9 . the code of locker 7 is", answer=" 4 1 9")] * 2
    pairs = [(item.prompt, item.answer + "\n") for item in items]
    rows = bench.item_rows(model, model, mapper, tokenizer, "prose_retrieval", pairs)
    assert len(rows) == 2 and rows[0]["tokens"] == len(tokenizer(items[0].prompt)["input_ids"])
    for row in rows:
        assert set(row["risk"]) == {bench.key(settings) for settings in bench.CANDIDATES}
        assert not any(row["changed"].values())
        assert all(correct == row["own_correct"] for correct in row["mapped_correct"].values())
        assert row["risk"]["prefix_audit:48"] < 1e-3


def test_benchmarks_readme_real_commands_parse():
    """Every `python -m benchmarks.real` command in benchmarks/README.md is one the package accepts (the docs match
    the code), both studies' commands among them."""
    import shlex

    from benchmarks.real.cli import build_parser

    text = (BENCHMARKS / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"^python -m benchmarks\.real (.+)$", text, re.MULTILINE)
    studies = [shlex.split(command, comments=True)[0] for command in commands]
    assert studies.count("family") >= 6 and studies.count("scale") >= 10
    for command in commands:
        build_parser().parse_args(shlex.split(command, comments=True))


def test_scale_scorer_scores_one_fitted_mapper_under_its_size(scale_script, tmp_path, monkeypatch):
    """`Scorer.score_mapper` (shared by the curve and the fine-tune) writes R^2 and every task, and skips both later."""
    rf = scale_script.rf
    calls = []
    monkeypatch.setattr(
        scale_script.modules.scale,
        "held_out_r2",
        lambda *a: calls.append("r2") or {"key_r2": [0.5], "value_r2": [0.25]},
    )
    scorer = object.__new__(scale_script.Scorer)
    model = type("Model", (), {"dtype": torch.float32})()
    scorer.models = {rf.SMALL: model, rf.LARGE: model}
    scorer.store, scorer.contexts, scorer.scores, scorer.path = None, [torch.zeros(1, 2)], {}, tmp_path / "s.json"
    scorer.tasks = [type("Task", (), {"name": "code_recall"})(), type("Task", (), {"name": "code_nll"})()]
    scorer.handoff = lambda source, target, mapper, first=False: (source, target, first)
    scorer.record = lambda key, task, handoff, mode, **extra: calls.append((key, handoff, mode, extra))
    mapper = torch.nn.Linear(1, 1)
    for _ in range(2):
        scorer.score_mapper(16384, rf.SMALL, rf.LARGE, "ridge-k8-attn", mapper, fit_seconds=1.0)
    assert calls.count("r2") == 1 and json.loads(scorer.path.read_text()) == {
        "r2|16384|0.5b-to-1.5b|ridge-k8-attn": {"key_r2": [0.5], "value_r2": [0.25]}
    }
    pair = (rf.SMALL, rf.LARGE, False)
    assert calls[1:3] == [
        ("code_recall|16384|0.5b-to-1.5b|ridge-k8-attn", pair, "mapped", {"fit_seconds": 1.0}),
        ("code_nll|16384|0.5b-to-1.5b|ridge-k8-attn", pair, "mapped", {"fit_seconds": 1.0}),
    ]
    # the target's own first layer: a handoff that computes it, no R^2 (the same map), its own variant name
    calls.clear()
    scorer.score_mapper(16384, rf.SMALL, rf.LARGE, "ridge-k8+target-L0", mapper, target_first_layer=True)
    assert calls == [
        ("code_recall|16384|0.5b-to-1.5b|ridge-k8+target-L0", (rf.SMALL, rf.LARGE, True), "mapped", {}),
        ("code_nll|16384|0.5b-to-1.5b|ridge-k8+target-L0", (rf.SMALL, rf.LARGE, True), "mapped", {}),
    ]


def test_scale_fitted_mapper_resolves_the_direction_and_the_largest_fit(scale_script, tmp_path):
    rf = scale_script.rf
    for positions in (2048, 16384, 8192):
        (tmp_path / "mappers" / str(positions) / "0.5b-to-1.5b" / "ridge-k8").mkdir(parents=True)
    assert scale_script.fitted_mapper(tmp_path, "0.5b-to-1.5b", "ridge-k8", None) == (rf.SMALL, rf.LARGE, 16384)
    assert scale_script.fitted_mapper(tmp_path, "0.5b-to-1.5b", "ridge-k8", 2048)[2] == 2048
    with pytest.raises(SystemExit, match="No 0.5b-to-1.5b/ridge-all fitted"):
        scale_script.fitted_mapper(tmp_path, "0.5b-to-1.5b", "ridge-all", None)


def test_feature_variants_are_valid_fit_options_that_need_features(scale_script):
    """Every `benchmarks.real scale features` variant is a valid `FitOptions`; all but the control need the features."""
    from hf_kvmap import FitOptions

    for name, spec in scale_script.FEATURE_VARIANTS.items():
        options = FitOptions(**spec)
        assert options.fits_on_features == (name != "ridge-k8-feat"), name


def test_readback_rows_keep_the_fact_and_read_calibration_files_only(tmp_path, byte_tokenizer, scale_script, tiny):
    """The KL fine-tune's read-back rows: one length, each ends with its answer and the end of turn, still states
    the answer before it after the crop, and every passage comes from a calibration file (the tasks read the rest)."""
    documents = corpus.discover(*tiny.fake_machine(tmp_path, files=30))
    opening = {"mod": "Module", "LICENSE-": "License"}  # each fake file opens with "Module N." or "License N."
    split = {(opening[m[1]], m[2]): d.split for d in documents if (m := re.search(r"(mod|LICENSE-)(\d+)", d.path))}
    rows = scale_script.readback_rows(byte_tokenizer, documents, 6, seed=5)
    assert len(rows) == 6 and len({len(row) for row in rows}) == 1
    files = set()
    for row in rows:
        text = byte_tokenizer.decode(row)
        assert text.endswith("<eos>")
        prompt, answer = text.removesuffix("<eos>").rsplit("<assistant>", 1)
        assert answer in prompt
        files |= set(re.findall(r"(License|Module) (\d+)\.", prompt))
    assert files and {split[n] for n in files} == {"calibration"}
    with pytest.raises(ValueError, match="cut the fact out"):
        scale_script.readback_rows(byte_tokenizer, documents, 6, seed=5, chat_passage=400)


def test_key_geometry_of_exact_and_scaled_keys(scale_script):
    keys = [torch.randn(1, 2, 7, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    exact = scale_script.key_geometry(keys, keys)
    assert exact == pytest.approx({"norm_ratio": 1.0, "cosine": 1.0, "r2": 1.0})
    doubled = scale_script.key_geometry([2 * k for k in keys], keys)
    assert doubled["norm_ratio"] == pytest.approx(2.0) and doubled["cosine"] == pytest.approx(1.0)
    assert doubled["r2"] < 0.5  # R^2 sees the scale that the cosine ignores


def test_stored_prefills_map_as_the_handoff_maps_a_left_padded_batch(tmp_path, one_thread):
    """The benchmarks' `CachedHandoff` takes the builder's prefill from a `PrefillStore` and must map it exactly as
    `HandoffEvaluation` does, padded rows included (a store that built at mask positions while the mapping stripped at
    0..T-1 once scored every left-padded row of a batch wrong, silently). Checked twice: computing the prefills and
    loading them back."""
    from benchmarks.real.common import PrefillStore, cached_handoff_class
    from hf_kvmap import MapperModel, zoo
    from hf_kvmap.evaluation import HandoffEvaluation

    source, target = zoo.load_model("tiny-m"), zoo.load_model("tiny-l")
    mapper, tokenizer = MapperModel.from_pretrained(zoo.mapper_path("tiny-m", "tiny-l")), zoo.load_tokenizer()
    texts = ["the code of locker 7 is 4 1 9 . the code of locker 7 is", "locker 2 holds 8 . locker 2 holds"]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert int((mask == 0).sum()) > 0  # a padded row is what the check is about
    plain = HandoffEvaluation(source=source, target=target, mapper=mapper, tokenizer=tokenizer)
    store = PrefillStore(tmp_path)
    cached = cached_handoff_class()(
        source, target, mapper, tokenizer, store=store, names={id(source): "s", id(target): "t"}
    )
    _, want = plain.context_cache("mapped", ids, mask)
    for _ in range(2):
        _, got = cached.context_cache("mapped", ids, mask)
        for a, b in zip(got.layers, want.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
    assert (store.computed, store.loaded) == (1, 1)
    with pytest.raises(ValueError, match="position_ids"):
        PrefillStore(tmp_path / "other").cache("s", source, ids, mask)
