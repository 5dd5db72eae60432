"""Saves a kill cannot tear. A saving process is killed (`os._exit`, no clean-up) before each step it takes on the
file system, one kill point per run, every step in turn (the steps are found, not listed: an audit hook counts every
write, rename, folder creation, removal and foreign call of the save); after each kill the destination must load as
the previous artifact or as the complete new one, by the library's own loader, with no save in between, and the next
save must succeed and leave nothing behind. Mapper folders (also where folders cannot be exchanged in one step),
cache files, JSON results, statistics folders and plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_kvmap import CalibrationStatistics, MapperModel
from hf_kvmap.delivery import save_cache

# Run in a fresh interpreter: it loads the new artifact once, then forks one child per kill point; the child installs
# the audit hook (hooks cannot be removed) and saves; the parent checks what the kill left and saves again.
DRIVER = r"""
import json, os, shutil, sys
from pathlib import Path

import torch

torch.set_num_threads(1)
kind, mode, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
destination, pristine, new_source = work / "dest", work / "pristine", work / "new"
KILLED = 77
MUTATING = {"open", "os.rename", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree", "ctypes.call_function",
            "os.chdir", "os.truncate", "os.symlink", "os.link", "os.chmod", "shutil.copyfile", "shutil.move"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

if kind == "mapper":
    from hf_kvmap import MapperModel
    new = MapperModel.from_pretrained(new_source)
    save = lambda: new.save_pretrained(destination)
    state = lambda path=destination: MapperModel.from_pretrained(path).config.content_hash
elif kind == "cache":
    from hf_kvmap.delivery import load_cache, read_provenance, save_cache
    new = load_cache(new_source)[0]
    save = lambda: save_cache(new, destination)
    state = lambda path=destination: (load_cache(path), read_provenance(path)["content_sha256"])[1]
elif kind == "json":
    from hf_kvmap.reporting import write_json
    new = json.loads(new_source.read_text())
    save = lambda: write_json(destination, new)
    state = lambda path=destination: json.loads(path.read_text())["which"]
elif kind == "statistics":
    from hf_kvmap import CalibrationStatistics
    new = CalibrationStatistics.load(new_source)
    save = lambda: new.save(destination)
    state = lambda path=destination: CalibrationStatistics.load(path).fingerprint
elif kind == "plot":
    from hf_kvmap.plotting import plot_diagnostics
    destination, pristine = work / "dest.png", work / "pristine.png"
    diagnostics = json.loads(new_source.read_text())
    save = lambda: plot_diagnostics(diagnostics, destination)
    state = lambda path=destination: __import__("hashlib").sha256(path.read_bytes()).hexdigest()
if mode == "two-renames":
    import hf_kvmap.atomic
    hf_kvmap.atomic.exchange = lambda first, second: False  # a system that cannot exchange two folders

def under_work(value):
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fsdecode(value)
        return not os.path.isabs(path) or os.path.abspath(path).startswith(str(work))
    return False

def counts(event, args):
    if event not in MUTATING:
        return False
    if event == "open":
        path, mode_, flags = args
        writes = (flags or 0) & WRITE_FLAGS or (mode_ is not None and any(c in str(mode_) for c in "wax+"))
        return bool(writes) and (isinstance(path, int) or under_work(path))
    if event == "ctypes.call_function":
        return True
    return any(under_work(arg) for arg in args[:2])

# whether an event changes the destination itself other than by renaming a finished artifact onto it (the one
# change a kill cannot tear)
def direct(event, args):
    paths = [os.path.abspath(os.fsdecode(arg)) for arg in args[:2] if isinstance(arg, (str, bytes, os.PathLike))]
    if event == "os.rename":
        return paths[:1] == [str(destination)]
    if event == "open" and not isinstance(args[0], int):
        return paths[:1] == [str(destination)] and counts(event, args)
    return event != "ctypes.call_function" and str(destination) in paths[:1]

def reset():
    for entry in work.iterdir():
        if entry.name.startswith((".dest", "dest")):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    (shutil.copytree if pristine.is_dir() else shutil.copyfile)(pristine, destination)

rows, point = [], 1
while True:
    reset()
    pid = os.fork()
    if pid == 0:
        seen, log = [0], os.open(work / "direct.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        def hook(event, args):
            if counts(event, args):
                if direct(event, args):
                    os.write(log, f"{event} {args[:2]}\n".encode())
                seen[0] += 1
                if seen[0] == point:
                    os._exit(KILLED)
        sys.addaudithook(hook)
        try:
            save()
        except BaseException:
            os._exit(3)
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    direct_changes = (work / "direct.log").read_text().splitlines()
    left = sorted(entry.name for entry in work.iterdir() if entry.name.startswith(".dest"))
    # a folder moved aside that loading would put back (were the destination gone) must be the whole previous one
    aside = [entry / "folder" for entry in work.iterdir() if entry.name.endswith(".old") and (entry / "folder").is_dir()]
    try:
        aside = [state(folder) for folder in aside]
    except Exception as error:
        aside = [f"unloadable: {type(error).__name__}: {error}"]
    try:
        found = state()  # the destination as the library loads it, with no save in between
    except Exception as error:
        found = f"unloadable: {type(error).__name__}: {error}"
    save()  # the next save cleans what the kill left
    again = state()
    clean = sorted(entry.name for entry in work.iterdir() if entry.name.startswith(".dest"))
    rows.append({"point": point, "code": code, "found": found, "left": left, "again": again, "clean": clean,
                 "direct": direct_changes, "aside": aside})
    if code != KILLED or point > 400:
        break
    point += 1
print("ROWS " + json.dumps(rows))
"""


@pytest.fixture(scope="module")
def artifacts(tiny, tmp_path_factory, one_thread):
    """For each kind: a folder holding the previous artifact (`pristine`), the new one (`new`) and the states they
    load as."""
    root = tmp_path_factory.mktemp("saves")
    config = tiny.config()
    made = {}

    def place(kind):
        work = root / kind
        work.mkdir()
        return work

    work = place("mapper")
    old, new = MapperModel.identity(config), MapperModel.identity(config)
    with torch.no_grad():
        new.layers[0].key_proj.weight.mul_(1.01)
    old.save_pretrained(work / "pristine")
    new.save_pretrained(work / "new")
    made["mapper"] = (work, old.config.content_hash, new.config.content_hash)

    work = place("cache")
    model = tiny.model(config)
    hashes = [
        save_cache(tiny.prefill(model, torch.arange(3, 3 + n)[None]), work / name)["content_sha256"]
        for name, n in (("pristine", 9), ("new", 12))
    ]
    made["cache"] = (work, *hashes)

    work = place("json")
    (work / "pristine").write_text(json.dumps({"which": "old"}))
    (work / "new").write_text(json.dumps({"which": "new", "rows": list(range(5000))}))
    made["json"] = (work, "old", "new")

    work = place("statistics")
    source, target = tiny.model(config, seed=0), tiny.model(config, seed=1)
    fingerprints = []
    for name, seed in (("pristine", 1), ("new", 2)):
        stats = CalibrationStatistics.collect(source, target, tiny.batches(seed=seed, count=1), progress=False)
        stats.save(work / name)
        fingerprints.append(stats.fingerprint)
    made["statistics"] = (work, *fingerprints)

    pytest.importorskip("matplotlib")
    from hashlib import sha256

    from hf_kvmap.plotting import plot_diagnostics

    work = place("plot")
    images = []
    for name, value in (("pristine", 0.25), ("new", 0.75)):
        diagnostics = {"layers": [{key: [value, 1 - value] for key in ("key_r2", "value_r2", "attention_cosine")}]}
        (work / name).write_text(json.dumps(diagnostics))
        plot_diagnostics(diagnostics, work / f"{name}.png")
        images.append(sha256((work / f"{name}.png").read_bytes()).hexdigest())
    made["plot"] = (work, *images)
    return made


CASES = [
    ("mapper", "exchange"),
    ("mapper", "two-renames"),
    ("cache", "exchange"),
    ("json", "exchange"),
    ("statistics", "exchange"),
    ("statistics", "two-renames"),
    ("plot", "exchange"),
]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="kills forked savers (Linux)")
@pytest.mark.parametrize(("kind", "mode"), CASES, ids=["-".join(case) for case in CASES])
def test_a_kill_at_every_step_of_a_save_leaves_the_old_or_the_new_artifact(artifacts, kind, mode):
    work, old, new = artifacts[kind]
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, kind, mode, str(work)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.split("ROWS ", 1)[1])
    *killed, finished = rows
    assert finished["code"] == 0 and finished["found"] == new  # the save without a kill completes
    if mode == "exchange":  # the destination itself changes only by one rename (or exchange) of a finished artifact
        assert finished["direct"] == [], finished["direct"]
    assert len(killed) >= 3 and all(row["code"] == 77 for row in killed)
    for row in rows:
        assert row["found"] in (old, new), row  # loadable, as one of the two, at every kill point
        assert row["again"] == new and row["clean"] == [], row  # the next save succeeds and cleans up
        assert all(state == old for state in row["aside"]), row  # what loading could put back is the old whole
    found = [row["found"] for row in killed]
    # the old artifact until the one step that swaps the new one in, the new one from there on
    assert found[0] == old and found == sorted(found, key=lambda state: state == new), found
    if kind in ("mapper", "statistics") and mode == "exchange":
        assert new in found  # killed after the exchange, before the previous folder was removed


def test_two_renames_killed_between_them_are_recovered_by_loading_alone(tmp_path, tiny):
    """Where folders cannot be exchanged: the previous mapper, moved aside by a save that died before moving the new
    one in, is what `from_pretrained` loads (no save needed)."""
    config = tiny.config()
    old = MapperModel.identity(config)
    old.save_pretrained(tmp_path / "src")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    moved = tmp_path / f".m.pid{dead.pid}.abc.old"
    moved.mkdir()
    (tmp_path / "src").rename(moved / "folder")
    loaded = MapperModel.from_pretrained(tmp_path / "m")
    assert loaded.config.content_hash == old.config.content_hash
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_statistics_are_saved_into_a_folder_of_their_own(random_pair_stats, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt.*their own folder"):
        random_pair_stats.save(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    random_pair_stats.save(tmp_path / "stats")  # the control: a new folder
    random_pair_stats.save(tmp_path / "stats")  # and the one a previous save wrote
    assert CalibrationStatistics.load(tmp_path / "stats").fingerprint == random_pair_stats.fingerprint


def test_saved_artifacts_have_the_permissions_the_umask_gives(tiny, tmp_path):
    """A saved folder and its files read like anything else the user writes (a private temporary folder made the
    swapped-in mapper unreadable to others), and a replaced file keeps the permissions it had."""
    import stat

    from hf_kvmap.reporting import write_json

    previous = os.umask(0o022)
    try:
        MapperModel.identity(tiny.config()).save_pretrained(tmp_path / "m")
        write_json(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(previous)
    mode = lambda path: stat.S_IMODE(path.stat().st_mode)  # noqa: E731
    assert mode(tmp_path / "m") == 0o755 and mode(tmp_path / "r.json") == 0o644
    assert mode(tmp_path / "m" / "config.json") == mode(tmp_path / "m" / "README.md") == 0o644  # (safetensors: 0600)
    os.chmod(tmp_path / "r.json", 0o640)
    write_json(tmp_path / "r.json", {"a": 2})
    assert mode(tmp_path / "r.json") == 0o640 and json.loads((tmp_path / "r.json").read_text()) == {"a": 2}
