"""`MapperConfig` and `FitOptions`: the contract of a mapper and of its fit, validated once."""

from __future__ import annotations

import json

import pytest

from hf_kvmap import FitOptions, MapperConfig, MapperModel, zoo
from hf_kvmap.configuration_mapper import summarize_model_config


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"kind": "lstm"}, "kind='lstm'"),
        ({"lambda_convention": "relative"}, "lambda_convention"),
        ({"ridge_lambda": -1.0}, "ridge_lambda"),
        ({"source_layers": [[0]]}, "source_layers has 1 entries"),
        ({"source_layers": [[0], [5]]}, "names source layers \\[5\\]"),
        ({"source_layers": [[0], []]}, "is empty"),
    ],
)
def test_config_validation(tiny, kwargs, fragment):
    side = summarize_model_config(tiny.SUPPORTED["qwen3"]())
    with pytest.raises(ValueError, match=fragment):
        MapperConfig(source_summary=side, target_summary=side, **kwargs)


def _config(model_config, **kwargs) -> MapperConfig:
    side = summarize_model_config(model_config)
    return MapperConfig(source_summary=side, target_summary=side, **kwargs)


def test_config_validates_and_sizes_the_inputs(tiny, tmp_path):
    config = tiny.SUPPORTED["qwen3"]()
    width = config.num_key_value_heads * config.head_dim
    assert _config(config).input_width(0) == width
    assert _config(config, context_window=3).input_width(0) == 4 * width
    assert _config(config, input_kinds="both", context_window=2).input_width(0) == 6 * width
    for kwargs, fragment in (
        ({"context_window": -1}, "context_window=-1"),
        ({"context_window": True}, "context_window=True"),
        ({"context_window": 1.5}, "context_window=1.5"),
        ({"input_kinds": "keys"}, "input_kinds='keys'"),
    ):
        with pytest.raises(ValueError, match=fragment):
            _config(config, **kwargs)
    mapper = MapperModel(_config(config, input_kinds="both", context_window=2))
    mapper.save_pretrained(tmp_path)
    loaded = MapperModel.from_pretrained(tmp_path)
    assert (loaded.config.input_kinds, loaded.config.context_window) == ("both", 2)
    assert loaded.layers[0].key_proj.weight.shape == (width, 6 * width)
    assert "| context window (earlier positions read) | 2 |" in (tmp_path / "README.md").read_text()


@pytest.mark.parametrize(
    "changes,fragment",
    [
        ({"kind": "lstm"}, "kind='lstm'"),
        ({"top_k": 0}, "top_k=0"),
        ({"top_k": True}, "top_k=True"),
        ({"ridge_lambda": -1.0}, "ridge_lambda=-1.0"),
        ({"val_fraction": 1.0}, "val_fraction=1.0"),
        ({"init": "zeros"}, "init='zeros'"),
        ({"context_window": -2}, "context_window=-2"),
        ({"lr": 0.0}, "lr=0.0"),
    ],
)
def test_fit_options_refuse_bad_values(changes, fragment):
    with pytest.raises(ValueError, match=fragment):
        FitOptions(**changes)
    with pytest.raises(ValueError, match=fragment):
        FitOptions().replace(**changes)


def test_fit_options_defaults_are_the_papers_and_unknown_names_are_refused():
    options = FitOptions()
    assert (options.kind, options.top_k, options.ridge_lambda, options.context_window) == ("ridge", 8, 0.01, 0)
    assert not options.fits_on_features
    assert FitOptions(kind="mlp").fits_on_features and FitOptions(context_window=1).fits_on_features
    assert FitOptions(input_kinds="both").fits_on_features
    with pytest.raises(TypeError, match="Unknown fitting options \\['hidden'\\]"):
        options.replace(hidden=3)


def test_configs_saved_with_the_former_field_names_load(tiny, tmp_path):
    side = summarize_model_config(tiny.SUPPORTED["qwen3"]())
    config = MapperConfig.from_dict({"model_type": "kvmap_mapper", "source_config": side, "target_config": side})
    assert config.source_summary == config.target_summary == side
    saved = config.to_dict()
    assert saved["source_summary"] == side and "source_config" not in saved and "target_config" not in saved
    # a saved mapper in the former format (fields named source_config/target_config) loads and verifies
    import shutil

    folder = tmp_path / "former"
    shutil.copytree(zoo.mapper_path("tiny-l", "tiny-s"), folder)
    saved = json.loads((folder / "config.json").read_text())
    saved["source_config"], saved["target_config"] = saved.pop("source_summary"), saved.pop("target_summary")
    (folder / "config.json").write_text(json.dumps(saved))
    assert MapperModel.from_pretrained(folder).config.source_summary == saved["source_config"]
