"""Every place where hf-kvmap depends on how a particular transformers version lays things out.

Keep version gates here and nowhere else.
"""

from __future__ import annotations

import functools
import importlib

import transformers
from packaging import version
from torch import nn
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

TRANSFORMERS_VERSION = version.parse(transformers.__version__)
MIN_TRANSFORMERS = version.parse("5.16.1")


def check_transformers_version() -> None:
    """Raise if the installed transformers is older than the lowest one the suite runs on (5.16.1, the lowest that
    vLLM 0.32/0.33 and SGLang 0.5.23 allow; `.ci/run` tests it and the newest release)."""
    if TRANSFORMERS_VERSION < MIN_TRANSFORMERS:
        raise ImportError(
            f"hf-kvmap needs transformers>={MIN_TRANSFORMERS} (found {transformers.__version__}): "
            "`pip install -U 'transformers>=5.16.1,<6'`."
        )


def rotary_embedding_class(config: PretrainedConfig) -> type[nn.Module]:
    """The rotary-embedding class that transformers' own modeling file for `config.model_type` defines.

    The base-model class registered with `AutoModel` (e.g. `Qwen3Model`) lives in the modeling module that also
    defines the matching `<Prefix>RotaryEmbedding`; instantiating that class with the config reproduces exactly the
    cos/sin the model applies (every `rope_type`, attention scaling included).
    """
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = config.model_type
    base_name = MODEL_MAPPING_NAMES.get(model_type)
    if base_name is None:
        raise ValueError(f"transformers has no base model registered for model_type={model_type!r}.")
    base_cls = getattr(transformers, base_name)
    module = importlib.import_module(base_cls.__module__)
    rotary_name = base_name[: -len("Model")] + "RotaryEmbedding" if base_name.endswith("Model") else None
    rotary_cls = getattr(module, rotary_name, None) if rotary_name else None
    if rotary_cls is None:
        raise ValueError(
            f"Could not find the rotary embedding of model_type={model_type!r} in {module.__name__} "
            f"(looked for `{rotary_name}`)."
        )
    return rotary_cls


def model_id(config: PretrainedConfig) -> str | None:
    """The Hub id or local path a model was loaded from (`None` for a model built from a config)."""
    return getattr(config, "name_or_path", None) or None


def model_revision(config: PretrainedConfig) -> str | None:
    """The commit hash of the Hub revision a model was loaded from, when transformers recorded it."""
    # transformers keeps it on the config as `_commit_hash` (no public accessor in 5.x).
    return getattr(config, "_commit_hash", None) or None


def set_model_revision(config: PretrainedConfig, revision: str) -> None:
    """Record a revision on a config the way transformers does for Hub models (see `model_revision`)."""
    config._commit_hash = revision


def init_cache_with_layers(cache: Cache, layers: list) -> None:
    """Initialize a `DynamicCache` subclass around layers already built.

    `DynamicCache.__init__` (5.23) builds its layers only from `ddp_cache_data` or a model config; the base `Cache`
    takes ready layers, so a cache holding mapped layers is initialized through it.
    """
    Cache.__init__(cache, layers=layers)


def unhooked_forward(module: nn.Module):
    """`module.forward` without the hook accelerate's `dispatch_model` wraps around it.

    A model dispatched with a `device_map` gets a top-level `AlignDevicesHook` that moves the inputs to the main device
    and the outputs back to the inputs' device. A mapper's outputs must instead stay where each mapper layer ran
    (beside the target layer that reads them); the layers' own hooks still place their computation.
    """
    return type(module).forward.__get__(module)


@functools.cache
def cache_argument() -> str:
    """The name under which the installed transformers' causal LMs take a cache.

    transformers 5.24 renamed `past_key_values` to `cache` (outputs' `.cache`): its `forward` and `generate` take
    `cache=` and warn (FutureWarning, removal in 6.0) on `past_key_values=`, while 5.16.1 to 5.23 declare only
    `past_key_values`, and a `cache=` given to its `forward` lands in `**kwargs` and is
    ignored without an error. Read from the signature of a model class, so the library passes the name the
    installed version declares.
    """
    import inspect

    from transformers import LlamaForCausalLM

    return "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{name: cache}` for a forward or `generate` call of the installed transformers (see `cache_argument`)."""
    return {cache_argument(): cache}


def output_cache(outputs):
    """The cache a model (or `generate`) output carries: `.cache` where the installed transformers has it (5.24,
    where reading `.past_key_values` logs a deprecation), else `.past_key_values` (5.16.1 to 5.23)."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values


def attention_implementation(model) -> str:
    """The attention implementation a loaded model runs (`"eager"`, `"sdpa"`, `"flash_attention_2"`, ...).

    transformers keeps it on the config as `_attn_implementation` (no public accessor in 5.x); a config that never set
    one runs eager attention.
    """
    return getattr(model.config, "_attn_implementation", None) or "eager"


def mapper_load_kwargs(kwargs: dict) -> dict:
    """`from_pretrained` keyword arguments for a mapper: hub kernels off unless the caller asks for them.

    transformers 5.25 kernelizes every model it loads by default (`use_kernels=None` means on where the `kernels`
    package is installed, and 5.25 installs it), and `kernels` refuses a device map whose first accelerator is
    `meta` ("Unsupported device type 'meta'"). A mapper has no layer a hub kernel replaces, so kernelizing it does
    nothing but can fail; 5.16.1 to 5.24 already default to `use_kernels=False`, which this keeps on every version.
    """
    return {"use_kernels": False, **kwargs}
