"""Manifests of the named model pairs (JSON beside this file; no weights). Installed as ``mtad_edge.models``."""

from pathlib import Path

MANIFEST_DIR = Path(__file__).resolve().parent
