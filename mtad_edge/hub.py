"""Model files on the Hugging Face Hub: ``hf:`` references, downloads, and their one-line errors.

A reference names one GGUF file in a model repository, the way llama.cpp's ``-hf`` does:

    hf:OWNER/REPO/PATH/FILE.gguf      that file
    hf:OWNER/REPO:Q4_K_M              the repository's .gguf file of that quantization
    hf:OWNER/REPO                     Q4_K_M, or the repository's only .gguf file
    hf:OWNER/REPO@REVISION/...        a branch, tag or commit (default: main)

Manifests name the same in a role's ``"hub"`` entry (``{"repo", "file", "quant", "revision", "sha256", "size"}``
or a reference string). Why this module exists on its own:

- ``huggingface_hub`` is imported here only, and only when a hub reference is used, so the offline default path
  (the packaged pairs) never pays for it. Downloads go through its cache (``HF_HUB_CACHE`` / ``HF_HOME``), which
  is shared with every other tool that uses the Hub and resumes a transfer that breaks off (within a run; 0.x
  also across runs). A file already in the cache is used without asking the hub, so a run never waits on it.
- The environment is read at call time (``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, the cache folders) and passed
  explicitly, because huggingface_hub reads some of it once at import.
- Every file is checked against a sha256 before it is used: the manifest's, else the hub's LFS hash (which the
  cache also uses as the file's blob name). A mismatch removes the file from the cache and stops.
- Every failure (unknown repository or file, gated repository, no network and nothing cached, an interrupted or
  corrupt transfer) becomes one ``MtadEdgeError`` line that names the reference.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

import mtad_edge.store as store
from mtad_edge.runtime.errors import MtadEdgeError, first_line, quoted

PREFIX = "hf:"
DEFAULT_QUANT = "Q4_K_M"  # what llama.cpp's -hf picks when a reference names no file
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRIES = 3  # attempts for a transfer that breaks off (huggingface_hub 0.x resumes the partial file, later ones restart)
_REF = re.compile(r"(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[^/:]+))?(?:/(?P<file>.+)|:(?P<quant>[\w.-]+))?")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")  # what huggingface_hub writes into the cache's refs/REVISION
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_TRUE = {"1", "on", "yes", "true"}
REPO_NAME_MAX = 96  # characters of an owner's or a repository's name on the hub
NAME_MAX = 255  # bytes in one part of a path (Linux, macOS and Windows alike)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class HubRef:
    """One GGUF file on the hub (``file``), or the one of a quantization (``quant``) to be looked up."""

    repo: str
    file: Optional[str] = None
    quant: Optional[str] = None
    revision: str = "main"
    sha256: Optional[str] = None  # pinned by a manifest; otherwise the hub's LFS hash is used
    size: Optional[int] = None  # bytes, from a manifest (shown by `models list`)

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision != "main" else ""
        tail = f"/{self.file}" if self.file else f":{self.quant}" if self.quant else ""
        return f"{PREFIX}{self.repo}{rev}{tail}"


def is_ref(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse(ref: str) -> HubRef:
    """``hf:OWNER/REPO[@REV][/FILE.gguf | :QUANT]`` -> HubRef (bad syntax is a one-line error)."""
    m = _REF.fullmatch(ref[len(PREFIX) :] if is_ref(ref) else "")
    if not m or (m["file"] and not m["file"].lower().endswith(".gguf")):
        raise MtadEdgeError(f"{quoted(ref)} is not a hub reference: use hf:OWNER/REPO/FILE.gguf or hf:OWNER/REPO:QUANT")
    return _inside(HubRef(m["repo"], m["file"], m["quant"].upper() if m["quant"] else None, m["rev"] or "main"))


def _inside(ref: HubRef) -> HubRef:
    """``ref``, when its repository, file and revision name places inside the hub cache's folder of
    that repository: a '..' or '.' part, an empty part, a backslash or an absolute path would reach
    outside it (and load an unhashed local file), so it is refused. Names longer than the hub's
    (REPO_NAME_MAX) or the OS's (NAME_MAX) are refused too: no file can have them, and every error
    message names the reference whole (a 100,000-character owner made one of 100 kB)."""
    for what, value in (("repository", ref.repo), ("file", ref.file), ("revision", ref.revision)):
        if value is None:
            continue
        parts = value.split("/")
        bad_part = any(part in ("", ".", "..") for part in parts)
        if "\\" in value or bad_part or (what == "repository" and len(parts) != 2):
            want = "OWNER/NAME" if what == "repository" else "a path inside the repository"
            raise MtadEdgeError(
                f"hub reference refused: its {what} {quoted(value)} is not {want} (no '..', '.' or empty parts, "
                "no backslash, not absolute)"
            )
        most = REPO_NAME_MAX if what == "repository" else NAME_MAX
        if any(len(part.encode(errors="surrogatepass")) > most for part in parts):
            raise MtadEdgeError(f"hub reference refused: its {what} {quoted(value)} has a part over {most} bytes")
    return ref


def from_spec(spec: Union[str, dict]) -> HubRef:
    """A manifest role's ``"hub"`` entry: a reference string or ``{"repo", "file"|"quant", ...}``."""
    if isinstance(spec, str):
        return parse(spec)
    if not isinstance(spec, dict) or not spec.get("repo") or not (spec.get("file") or spec.get("quant")):
        raise MtadEdgeError(f"a manifest's hub entry needs repo and file (or quant), got {quoted(spec)}")
    for key in ("repo", "file", "quant", "revision"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise MtadEdgeError(f"a manifest's hub entry: {key} must be a string, got {quoted(spec[key])}")
    size = spec.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
        raise MtadEdgeError(f"a manifest's hub entry: size must be a number of bytes, got {quoted(size)}")
    sha = spec.get("sha256")
    if sha is not None and not _SHA256.match(str(sha)):
        raise MtadEdgeError(f"hub entry for {quoted(spec['repo'])}: sha256 must be 64 lowercase hex digits")
    return _inside(
        HubRef(
            spec["repo"],
            spec.get("file"),
            (spec.get("quant") or "").upper() or None,
            spec.get("revision") or "main",
            sha,
            spec.get("size"),
        )
    )


# -- settings, read at call time -------------------------------------------------------------
def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> Path:
    """huggingface_hub's cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("HF_HOME") or xdg / "huggingface").expanduser() / "hub"


def _hf():
    try:
        import huggingface_hub
    except ImportError:
        raise MtadEdgeError("hf: references need huggingface_hub: pip install huggingface_hub") from None
    return huggingface_hub


# -- fetching ----------------------------------------------------------------------------------
def fetch(ref: Union[str, HubRef], say: Progress = lambda s: None, refresh: bool = False) -> Path:
    """The local path of a hub file, checked against its sha256. A file already in the cache is used without asking
    the hub (as Ollama does: a run never waits on the network); ``refresh`` (``models pull``) asks whether an
    unpinned revision moved. Otherwise it is downloaded, resumably and with a progress bar. A split GGUF comes
    with all its parts; the first part is returned."""
    ref = parse(ref) if isinstance(ref, str) else ref
    info = _Info(ref)
    files = [ref.file] if ref.file else (_cached_files(ref) if offline() or not refresh else None)
    if files is None:
        if offline():
            raise MtadEdgeError(_not_cached(ref))
        files = pick_files(ref, info.listing())
    paths = [
        _fetch_one(replace(ref, file=f, sha256=ref.sha256 if len(files) == 1 else None), info, say, refresh)
        for f in files
    ]
    return paths[0]


def cached(ref: Union[str, HubRef]) -> Optional[Path]:
    """The file's path in the cache, or None; never touches the network (for `models list`)."""
    ref = parse(ref) if isinstance(ref, str) else ref
    files = [ref.file] if ref.file else _cached_files(ref)
    paths = [_cache_lookup(replace(ref, file=f)) for f in files or []]
    return paths[0] if paths and all(paths) else None


def _cached_files(ref: HubRef) -> Optional[list[str]]:
    """The cached file(s) of a quantization reference, when all of them are in the cache (looked up in the cached
    snapshot of its revision, so that a run needs no network)."""
    try:
        files = pick_files(ref, _cached_listing(ref) or [])
    except MtadEdgeError:
        return None
    return files if all(_cache_lookup(replace(ref, file=f)) for f in files) else None


class _Info:
    """The repository's file list, sizes and LFS hashes, asked of the model-info API at most once per fetch."""

    def __init__(self, ref: HubRef):
        self.ref = ref
        self._siblings: Optional[dict[str, Any]] = None

    def siblings(self) -> dict[str, Any]:
        if self._siblings is None:
            ref = self.ref
            info = _call(
                ref,
                lambda hf: hf.HfApi(endpoint=endpoint()).model_info(
                    ref.repo, revision=ref.revision, files_metadata=True
                ),
            )
            self._siblings = {s.rfilename: s for s in info.siblings or []}
        return self._siblings

    def listing(self) -> list[str]:
        return list(self.siblings())


def pick_files(ref: HubRef, names: list[str]) -> list[str]:
    """The .gguf file(s) of ``ref.quant`` among a repository's files (``mmproj`` projectors excluded)."""
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and "mmproj" not in n.lower().rsplit("/", 1)[-1])
    quant = ref.quant or DEFAULT_QUANT
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    hits = [n for n in ggufs if pattern.search(n.rsplit("/", 1)[-1][: -len(".gguf")])]
    if not hits and ref.quant is None and len(ggufs) == 1:
        hits = ggufs
    groups = {_SPLIT.sub("", n) for n in hits}
    if len(groups) == 1:
        return sorted(hits)  # one file, or the parts of one split file (00001 first)
    if not hits:
        have = sorted({q for n in ggufs for q in re.findall(r"(?i)\b(I?Q\d\w*|[BF]F?\d+)\b", n.rsplit("/", 1)[-1])})
        raise MtadEdgeError(
            f"{ref}: {ref.repo} has no .gguf file for {quant}"
            f" ({'it has ' + ', '.join(have) if have else 'it has no .gguf files'})"
        )
    raise MtadEdgeError(
        f"{ref}: {quant} matches several files ({', '.join(sorted(groups))}): name one as {PREFIX}{ref.repo}/FILE"
    )


def _snapshot_dir(ref: HubRef) -> Optional[Path]:
    """The cached snapshot of ``ref.revision``, by the cache's documented layout
    (models--OWNER--REPO/refs/REVISION holds the commit; snapshots/COMMIT/ holds the files)."""
    folder = cache_dir() / ("models--" + ref.repo.replace("/", "--"))
    commit = ref.revision
    if (folder / "refs" / ref.revision).is_file():
        try:
            commit = (folder / "refs" / ref.revision).read_text().strip()
        except (OSError, ValueError):  # unreadable or not text: a damaged cache is a cache without it
            return None
        if not _COMMIT.match(commit):  # a damaged ref ('../..' would name a folder outside the cache)
            return None
    snapshot = folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _cached_listing(ref: HubRef) -> Optional[list[str]]:
    snapshot = _snapshot_dir(ref)
    if snapshot is None:
        return None
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]


def _cache_lookup(ref: HubRef) -> Optional[Path]:
    """The cached file of ``ref.revision``, or None (what huggingface_hub's try_to_load_from_cache does, without
    importing it, so that `models list` stays cheap)."""
    snapshot = _snapshot_dir(ref)
    found = snapshot / ref.file if snapshot is not None and ref.file else None
    return found if found is not None and found.is_file() else None


def _fetch_one(ref: HubRef, info: _Info, say: Progress, refresh: bool) -> Path:
    local = _cache_lookup(ref)
    if local is not None and (ref.sha256 or not refresh or offline()):
        _verify(ref, local, say)  # hashed once, then stamped
        return local
    if local is None and not offline():
        _check_remote(ref, info, say)
    for attempt in range(1, _TRIES + 1):
        try:
            path = Path(
                _call(
                    ref,
                    lambda hf: hf.hf_hub_download(
                        ref.repo,
                        ref.file,
                        revision=ref.revision,
                        cache_dir=str(cache_dir()),
                        endpoint=endpoint(),
                        local_files_only=offline(),
                    ),
                    transfer=True,
                )
            )
            break
        except _Interrupted as e:
            if attempt == _TRIES:
                raise MtadEdgeError(f"{ref}: download interrupted ({e}); run the command again") from None
            say(f"{ref}: download interrupted ({e}); resuming")
    _verify(ref, path, say)
    return path


def _check_remote(ref: HubRef, info: _Info, say: Progress) -> None:
    """Before a download: the file must exist and be the one the manifest pins (no gigabytes for a refusal)."""
    siblings = info.siblings()
    if ref.file not in siblings:
        names = sorted(n for n in siblings if n.lower().endswith(".gguf"))
        raise MtadEdgeError(
            f"{ref}: {ref.repo} has no file {ref.file}" + (f" (its .gguf files: {', '.join(names)})" if names else "")
        )
    sibling = siblings[ref.file]
    lfs = getattr(sibling, "lfs", None)
    hub_sha = getattr(lfs, "sha256", None) if lfs is not None else None
    if ref.sha256 and hub_sha and hub_sha != ref.sha256:
        raise MtadEdgeError(
            f"{ref}: the hub's file (sha256 {hub_sha[:12]}...) is not the one the manifest names "
            f"({ref.sha256[:12]}...); not downloaded"
        )
    size = getattr(sibling, "size", None) or getattr(lfs, "size", None)
    say(f"downloading {ref}" + (f" ({human_size(size)})" if size else "") + f" from {endpoint()} into {cache_dir()}")


# -- checking ----------------------------------------------------------------------------------
def _verify(ref: HubRef, path: Path, say: Progress) -> None:
    """The file's sha256 against the manifest's, else the hub's LFS hash. The cache names a blob after the ETag the
    hub sent for it, which for an LFS file is its sha256. A checked file gets a stamp (store.py), so a 5 GB file is
    hashed once, not at every start."""
    blob = path.resolve()
    want = ref.sha256 or (blob.name if _SHA256.match(blob.name) else None)
    if want is None:
        say(f"warning: {ref}: the hub gave no sha256 for this file (not an LFS file?); not checked")
        return
    if store.stamped(blob) == want:
        return
    if blob.stat().st_size > 100 << 20:
        say(f"checking the sha256 of {ref.file} ({human_size(blob.stat().st_size)})")
    got = store.sha256_file(blob)
    if got != want:
        _evict(path, blob)
        whose = "the manifest's" if ref.sha256 else "the hub's LFS hash"
        raise MtadEdgeError(
            f"{ref}: sha256 of the download is {got[:12]}..., not {whose} {want[:12]}...; "
            f"removed it from the cache, run the command again to download it afresh"
        )
    store.remember(lambda: store.stamp(blob, want))


def _evict(pointer: Path, blob: Path) -> None:
    """Remove a bad file from the cache (its snapshot link and its blob), so the next run downloads it again."""
    for p in {pointer, blob}:
        p.unlink(missing_ok=True)


def human_size(n: Optional[int]) -> str:
    if not n:
        return "size unknown"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


# -- errors ------------------------------------------------------------------------------------
class _Interrupted(Exception):
    """A transfer that broke off (connection reset, short read): worth one more try, which resumes."""


def _call(ref: HubRef, fn, transfer: bool = False):
    """Run a huggingface_hub call; turn its exceptions into one line naming the reference. A network error is
    "cannot reach the hub", except during a ``transfer``, where it means the download broke off."""
    hf = _hf()
    from huggingface_hub import errors

    try:
        return fn(hf)
    except errors.LocalEntryNotFoundError:  # before EntryNotFoundError: a subclass of it in some versions
        raise MtadEdgeError(_not_cached(ref)) from None
    except errors.OfflineModeIsEnabled:
        raise MtadEdgeError(_not_cached(ref)) from None
    except errors.GatedRepoError:
        token = "your HF_TOKEN has no access to it yet" if _has_token() else "set HF_TOKEN (or run `hf auth login`)"
        raise MtadEdgeError(
            f"{ref}: {ref.repo} is gated: accept its terms on {endpoint()}/{ref.repo} and {token}"
        ) from None
    except errors.RepositoryNotFoundError:
        raise MtadEdgeError(
            f"{ref}: no repository {ref.repo} on {endpoint()} "
            f"(or it is private{'' if _has_token() else ': set HF_TOKEN'})"
        ) from None
    except errors.RevisionNotFoundError:
        raise MtadEdgeError(f"{ref}: {ref.repo} has no revision {quoted(ref.revision)}") from None
    except errors.EntryNotFoundError:
        raise MtadEdgeError(f"{ref}: {ref.repo} has no file {ref.file}") from None
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise MtadEdgeError(f"{ref}: the hub at {endpoint()} answered HTTP {status}: {first_line(e)}") from None
    except Exception as e:
        if not _is_network_error(e):
            raise
        if transfer:
            raise _Interrupted(type(e).__name__) from None
        raise MtadEdgeError(_not_cached(ref)) from None


def _not_cached(ref: HubRef) -> str:
    if offline():
        return f"{ref}: offline (HF_HUB_OFFLINE=1) and not in the cache {cache_dir()}"
    return f"{ref}: cannot reach {endpoint()} (offline?) and the file is not in the cache {cache_dir()}"


def _has_token() -> bool:
    return bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))


def _is_network_error(e: BaseException) -> bool:
    """requests / urllib3 (huggingface_hub < 1) or httpx (>= 1) failing to connect or mid-transfer, or the
    library's own size check ("Consistency check failed") after a short transfer."""
    libraries = {"requests", "urllib3", "httpx", "httpx2", "httpcore", "httpcore2"}
    if any(c.__module__.split(".")[0] in libraries for c in type(e).__mro__):
        return True
    return isinstance(e, (ConnectionError, TimeoutError)) or "Consistency check failed" in str(e)
