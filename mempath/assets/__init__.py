"""Models that ship inside the package (see scripts/train_default_model.py)."""
from pathlib import Path

ASSETS = Path(__file__).resolve().parent
DEFAULT_MODEL = "mempath-tiny"
DRAFT_MODEL = "mempath-tiny-draft"


def default_model_path() -> str:
    path = ASSETS / DEFAULT_MODEL
    if not (path / "config.json").exists():
        raise ValueError(
            f"the built-in model is missing from {path}; reinstall mempath or pass a model directory")
    return str(path)
